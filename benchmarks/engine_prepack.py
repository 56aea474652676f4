"""skyrl-torch rollouts with and without oneDNN-prepacked weights, side by side in one run.

SmolLM2-135M-Instruct in ``--dtype`` (bfloat16 by default: bf16 weights are prepacked since issue 20
where oneDNN computes bf16 on the CPU (AVX-512 or newer); fp32 ones were before), a batch of 64 chat-templated
prompts "What is a + b?", up to 32 new tokens at temperature 1, 2 threads. Two engines, one with
``prepack_weights: true`` (the default) and one with ``false``, run alternately ``--repeats``
times after a warm-up, with the same seeds: the prepacked GEMMs give the plain weights' bits, so
both sample the same tokens (checked), and only the time differs. Prints each run, the median
tokens/s of each and their ratio, the load average before and after, and the CPU.

    python benchmarks/engine_prepack.py [--dtype bfloat16] [--repeats 3] [--threads 2] [--batch 64]
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

from _roofline import machine, uptime


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--max-new-tokens", type=int, default=32)
    args = parser.parse_args()

    import torch

    from skyrl_core.config.schema import ModelConfig
    from skyrl_core.models import load_tokenizer, prepare_smollm2
    from skyrl_core.types import GenerationRequest, SamplingParams
    from skyrl_torch.engine import TorchEngine
    from skyrl_torch.options import TorchEngineOptions

    print("load before:", uptime(), flush=True)
    torch.set_num_threads(args.threads)
    model_config = ModelConfig(path=prepare_smollm2(), dtype=args.dtype)
    tokenizer = load_tokenizer(model_config)
    rng = random.Random(0)
    prompts = [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": f"What is {rng.randint(0, 49)} + {rng.randint(0, 49)}?"}],
            add_generation_prompt=True, tokenize=False,
        )
        for _ in range(args.batch)
    ]
    prompt_ids = [tokenizer(p, add_special_tokens=False)["input_ids"] for p in prompts]
    engines = {
        name: TorchEngine(model_config, TorchEngineOptions(max_num_seqs=args.batch, prepack_weights=flag), seed=0)
        for name, flag in (("prepacked", True), ("plain", False))
    }
    for name, engine in engines.items():
        print(f"{name}: {engine.execution_contract()['prepacked_gemm_operands']} prepacked GEMM operands", flush=True)

    def run(engine: TorchEngine, seed: int, max_new: int) -> list[list[int]]:
        requests = [
            GenerationRequest(request_id=str(i), prompt_token_ids=p, sampling=SamplingParams(max_tokens=max_new, seed=seed * 1000 + i))
            for i, p in enumerate(prompt_ids)
        ]
        return [list(s.token_ids) for group in engine.generate(requests) for s in group]

    for engine in engines.values():
        run(engine, 0, 2)
    rates: dict[str, list[float]] = {name: [] for name in engines}
    for rep in range(args.repeats):
        tokens_of: dict[str, list[list[int]]] = {}
        for name, engine in engines.items():
            start = time.perf_counter()
            tokens_of[name] = run(engine, rep + 1, args.max_new_tokens)
            seconds = time.perf_counter() - start
            count = sum(map(len, tokens_of[name]))
            rates[name].append(count / seconds)
            print(f"repeat {rep}  {name:9s} {count:5d} tokens in {seconds:6.2f} s = {count / seconds:7.1f} tokens/s", flush=True)
        if tokens_of["prepacked"] != tokens_of["plain"]:
            raise SystemExit("prepacked and plain engines sampled different tokens: the packed GEMMs changed bits")
    packed, plain = statistics.median(rates["prepacked"]), statistics.median(rates["plain"])
    print(f"{args.dtype}: median tokens/s prepacked {packed:.1f}, plain {plain:.1f}; prepacked / plain {packed / plain:.2f}x")
    print("load after:", uptime())
    print(machine())


if __name__ == "__main__":
    main()
