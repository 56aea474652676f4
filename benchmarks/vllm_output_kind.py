"""skyrl-vllm's async driver with vLLM's DELTA outputs (the driver now) against CUMULATIVE ones (the
driver before), side by side on one engine in one run.

With CUMULATIVE, vLLM re-sends every sample whole at every step (token ids, logprobs and text so
far), so the front-end's work grows with the square of the sample's length; with DELTA each step
sends its new tokens only and the driver puts the samples together (``async_driver._Sample``).
A tiny Qwen3 (random weights, so the model's own time is small and the output path shows)
generates ``--batch`` samples of exactly ``--tokens`` tokens each (``ignore_eos``), the two
drivers alternating ``--repeats`` times after one warm-up each. ``--stop`` gives every request a
stop string that never matches (agent environments stop at their tool tags): vLLM then holds back
the stop string's length of text, and CUMULATIVE copies the whole text so far at every step. The
last line is the ratio of the times, CUMULATIVE / DELTA.

    python benchmarks/vllm_output_kind.py [--tokens 512] [--batch 8] [--repeats 3] [--threads 2] [--stop]
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from typing import Any

from _common import bind_vllm_threads

TINY_QWEN3 = {
    "model_type": "qwen3", "vocab_size": 512, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32, "max_position_embeddings": 1024,
}


async def cumulative_one(driver: Any, prompt: Any, params: Any, request_id: str) -> list[Any]:
    """The driver's ``_one`` before DELTA (``async_driver.py`` at c64518f): CUMULATIVE outputs, the
    latest kept, progress from its length."""
    from vllm.sampling_params import RequestOutputKind

    params.output_kind = RequestOutputKind.CUMULATIVE
    vllm_id = f"{request_id}#{next(driver._ids)}"
    latest: dict[int, Any] = {}
    async for output in driver.engine.generate(prompt, params, vllm_id):
        with driver._lock:
            for completion in output.outputs:
                latest[completion.index] = completion
                if completion.finished():
                    driver._progress.pop((vllm_id, completion.index), None)
                else:
                    driver._progress[(vllm_id, completion.index)] = (request_id, len(completion.token_ids))
    return [latest[index] for index in sorted(latest)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=512)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--stop", action="store_true", help="a stop string that never matches, on every request")
    args = parser.parse_args()
    bind_vllm_threads(args.threads)
    os.environ.setdefault("VLLM_CACHE_ROOT", tempfile.mkdtemp(prefix="vllm-cache-"))

    import vllm
    from vllm.inputs import TokensPrompt

    from skyrl_core.config.schema import ModelConfig
    from skyrl_vllm.async_driver import AsyncVLLM
    from skyrl_vllm.engine import VLLMEngine
    from skyrl_vllm.options import VLLMOptions

    length = args.tokens + 16
    options = VLLMOptions(kv_cache_memory_bytes=64 << 20, max_model_len=length, max_num_seqs=args.batch)
    engine = VLLMEngine(ModelConfig(config={**TINY_QWEN3, "max_position_embeddings": length}), options, seed=0)
    driver: AsyncVLLM = engine._llm
    prompts = [TokensPrompt(prompt_token_ids=[1 + i, 2, 3, 4]) for i in range(args.batch)]

    def params() -> list[Any]:
        return [vllm.SamplingParams(max_tokens=args.tokens, ignore_eos=True, temperature=1.0, seed=i, logprobs=0,
                                 stop=["</never-emitted>"] if args.stop else None)
                for i in range(args.batch)]

    def delta() -> list[list[Any]]:
        return driver.generate(prompts, params(), [str(i) for i in range(args.batch)])

    def cumulative() -> list[list[Any]]:
        async def run() -> list[list[Any]]:
            import asyncio

            return list(await asyncio.gather(*(cumulative_one(driver, p, sp, str(i))
                                               for i, (p, sp) in enumerate(zip(prompts, params())))))
        return driver._run(run())

    runs = {"delta": delta, "cumulative": cumulative}
    times: dict[str, list[float]] = {name: [] for name in runs}
    try:
        outputs = {name: run() for name, run in runs.items()}  # warm-up, and the same samples both ways
        same = [[c.token_ids for c in r] for r in outputs["delta"]] == [[list(c.token_ids) for c in r]
                                                                       for r in outputs["cumulative"]]
        assert all(len(c.token_ids) == args.tokens for r in outputs["delta"] for c in r)
        print(f"samples equal both ways: {same}; load average {os.getloadavg()[0]:.1f}")
        for _ in range(args.repeats):
            for name, run in runs.items():
                started = time.perf_counter()
                run()
                times[name].append(time.perf_counter() - started)
    finally:
        engine.close()
    for name, values in times.items():
        print(f"{name:>10}: {statistics.median(values):.3f} s median of {[round(v, 3) for v in values]} "
              f"({args.batch} x {args.tokens} tokens{', stop string' if args.stop else ''})")
    print(f"cumulative / delta: {statistics.median(times['cumulative']) / statistics.median(times['delta']):.2f}x "
          f"(load average {os.getloadavg()[0]:.1f})")


if __name__ == "__main__":
    main()
