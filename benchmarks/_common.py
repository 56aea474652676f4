"""Shared by the rollout-throughput benchmarks (not a benchmark: ``make bench`` skips ``_*.py``).

The same workload for every engine: a batch of chat-templated prompts "What is a + b?" (a, b in
0..49, seeded), sampled at temperature 1 with a per-request seed; engines run alternately, each after
one warm-up, so that a busy machine slows all of them alike.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import time
from typing import Any


def rollout_parser(description: str) -> argparse.ArgumentParser:
    """``--repeats``, ``--threads``, ``--batch`` and ``--max-new-tokens``, with their defaults."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--max-new-tokens", type=int, default=32)
    return parser


def bind_vllm_threads(threads: int) -> None:
    """Bind vLLM's CPU worker to ``threads`` cores. Call before vLLM's processes start: they read
    both variables when they bind their threads."""
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", f"0-{threads - 1}")
    os.environ.setdefault("OMP_NUM_THREADS", str(threads))


def arithmetic_prompts(tokenizer: Any, batch: int) -> list[tuple[int, ...]]:
    """``batch`` chat-templated "What is a + b?" prompts as token ids (seeded: the same every run)."""
    rng = random.Random(0)
    texts = [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": f"What is {rng.randint(0, 49)} + {rng.randint(0, 49)}?"}],
            add_generation_prompt=True,
            tokenize=False,
        )
        for _ in range(batch)
    ]
    return [tuple(tokenizer(t, add_special_tokens=False)["input_ids"]) for t in texts]


def sampling_requests(prompts: list[tuple[int, ...]], seed: int, max_new: int) -> list[Any]:
    """One ``GenerationRequest`` per prompt at temperature 1, request ``i`` seeded ``seed * 1000 + i``."""
    from skyrl_core.types import GenerationRequest, SamplingParams

    return [
        GenerationRequest(
            request_id=str(i), prompt_token_ids=p,
            sampling=SamplingParams(seed=seed * 1000 + i, max_tokens=max_new, temperature=1.0),
        )
        for i, p in enumerate(prompts)
    ]


def time_alternately(
    engines: dict[str, Any], prompts: list[tuple[int, ...]], *, repeats: int, max_new_tokens: int, name_width: int,
    tokens_out: dict[str, list[int]] | None = None,
) -> dict[str, float]:
    """Warm every engine up, then run them alternately ``repeats`` times, printing each run; the
    median generated tokens/s (EOS included) of each engine. ``tokens_out`` collects each run's
    generated tokens per engine (for the roofline's FLOPs)."""
    for engine in engines.values():  # warm-up
        engine.generate(sampling_requests(prompts, seed=999, max_new=4))
    rates: dict[str, list[float]] = {name: [] for name in engines}
    for rep in range(repeats):
        for name, engine in engines.items():
            start = time.perf_counter()
            out = engine.generate(sampling_requests(prompts, seed=rep, max_new=max_new_tokens))
            elapsed = time.perf_counter() - start
            tokens = sum(len(s.token_ids) for group in out for s in group)
            rates[name].append(tokens / elapsed)
            if tokens_out is not None:
                tokens_out.setdefault(name, []).append(tokens)
            print(f"repeat {rep}: {name:{name_width}s} {tokens:5d} tokens in {elapsed:7.2f} s = {tokens / elapsed:8.1f} tok/s")
    return {name: statistics.median(r) for name, r in rates.items()}
