"""Where the Tinker RL step's training time goes: one ``forward_backward`` of the in-process LoRA
trainer on SmolLM2-135M at ``tinker_rl_step.py``'s shapes (64 data of a 4-token prompt and 32
sampled tokens, rank-8 LoRA on every projection, ``importance_sampling``), then:

- under PyTorch's profiler: the matrix products' own time and rate, and every other op's time;
- the same products again, alone, in the same order (one pair of operands per shape, so each
  shape's operands are warm), by kind: the base layers, the LoRA adapters' rank-8 products, the
  output head. Their rate is what this machine sustains on the step's own GEMM sequence, beside the
  roofline's best-of-bursts peak that ``tinker_rl_step.py`` divides by.

``python benchmarks/tinker_train_breakdown.py [--cpu-gemm auto|onednn|torch]``. The step's products
go to PyTorch's BLAS (``aten::mm``) with ``--cpu-gemm torch`` (``auto`` where it chose torch); with
oneDNN they are not ``aten::mm`` calls and the profile's product share reads 0.
"""

from __future__ import annotations

import argparse
import collections
import time

import numpy as np
import torch

from _roofline import machine

BASE_PARAMS = 134.5e6  # SmolLM2-135M's parameters (the tied head counted once)


def examples(count: int = 64, prompt: int = 4, sampled: int = 32, vocab: int = 49152):
    from skyrl_tinker.trainer import Example

    rng = np.random.default_rng(0)
    out = []
    for _ in range(count):
        full = rng.integers(0, vocab, size=prompt + sampled)
        advantages = np.r_[np.zeros(prompt - 1), rng.normal(size=sampled)].astype(np.float32)
        out.append(Example(full[:-1].astype(np.int64), {"target_tokens": full[1:].astype(np.int64),
                                                         "logprobs": -rng.random(len(full) - 1).astype(np.float32),
                                                         "advantages": advantages}))
    return out


def kind_of(m: int, k: int, n: int) -> str:
    if min(m, k, n) <= 16:
        return "lora"
    return "head" if max(k, n) >= 49152 else "base"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cpu-gemm", default="torch", choices=("auto", "onednn", "torch"))
    args = parser.parse_args()
    print(machine(), flush=True)

    from torch.profiler import ProfilerActivity, profile

    from skyrl_core.models import prepare_smollm2
    from skyrl_tinker.trainer import LoraTrainer

    trainer = LoraTrainer(prepare_smollm2(), cpu_gemm=args.cpu_gemm)
    trainer.create("a", rank=8, alpha=32.0, groups=("attn", "mlp"), seed=0)
    data = examples()
    positions = sum(len(e.tokens) for e in data)
    trainer.forward_backward("a", data, "importance_sampling", None)  # warm-up
    start = time.perf_counter()
    trainer.forward_backward("a", data, "importance_sampling", None)
    step = time.perf_counter() - start
    model_flops = 4 * BASE_PARAMS * positions  # forward + input gradients (LoRA: no base weight gradients)
    print(f"forward_backward: {positions} positions, {step:.2f} s, {model_flops / step / 1e9:.1f} GFLOP/s of model work", flush=True)

    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        trainer.forward_backward("a", data, "importance_sampling", None)
    shapes: list[tuple[int, int, int]] = []
    mm_seconds = 0.0
    for event in prof.events():
        if event.name == "aten::mm":
            (m, k), (_, n) = event.input_shapes[0], event.input_shapes[1]
            shapes.append((m, k, n))
            mm_seconds += event.self_cpu_time_total / 1e6
    total = sum(e.self_cpu_time_total for e in prof.key_averages()) / 1e6
    mm_flops = sum(2 * m * k * n for m, k, n in shapes)
    rate = mm_flops / mm_seconds / 1e9 if mm_seconds else 0.0
    print(f"profiled: {total:.2f} s of ops; products {mm_seconds:.2f} s ({mm_seconds / total:.0%}, {len(shapes)} calls, "
          f"{rate:.1f} GFLOP/s); every other op {total - mm_seconds:.2f} s ({(total - mm_seconds) / total:.0%})", flush=True)
    if not shapes:
        return

    operands = {s: (torch.randn(s[0], s[1]), torch.randn(s[1], s[2])) for s in set(shapes)}
    by_kind: dict[str, list[tuple[int, int, int]]] = collections.defaultdict(list)
    for s in shapes:
        by_kind[kind_of(*s)].append(s)
    print("the same products alone, in order (best of 2):", flush=True)
    for kind in ("base", "lora", "head"):
        work = by_kind.get(kind, [])
        flops = sum(2 * m * k * n for m, k, n in work)
        best = float("inf")
        for _ in range(2):
            start = time.perf_counter()
            for s in work:
                a, b = operands[s]
                a.mm(b)
            best = min(best, time.perf_counter() - start)
        print(f"  {kind:<5} {len(work):6d} calls {flops / 1e12:7.3f} TFLOP {best:7.2f} s {flops / best / 1e9:7.1f} GFLOP/s", flush=True)


if __name__ == "__main__":
    main()
