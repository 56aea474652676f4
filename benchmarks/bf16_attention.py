"""The FSDP trainer's bf16 ``forward_backward`` with short attention written out against PyTorch's
flash kernel, side by side in one process (``skyrl_core.ops.short_attention``).

The work: an RL step's batch on SmolLM2-135M-Instruct (64 rows, prompts of 40-50 tokens, responses of
5-32, random tokens), ``micro_batch_size`` 16, one rank, ``mixed_precision: bf16``, then
``optim_step``. Two backends in one process, run alternately ``--rounds`` times after a warm-up
round: "short" (the default: calls within ``MAX_SCORES`` written out) and "flash" (``MAX_SCORES``
0: every call on PyTorch's sdpa). Also, in isolation, one attention call's forward and backward at
the micro-batch's shape. Prints each time, the medians, their ratio and the CPU.

    python benchmarks/bf16_attention.py [--rounds 4] [--threads 2]
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

from _roofline import machine, uptime


def isolated(rounds: int) -> dict[str, float]:
    """ms of one attention call's forward + backward, [16, 9, 78, 64] queries, 3 key heads, bf16."""
    import torch
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from types import SimpleNamespace

    from skyrl_core.ops import short_attention

    gen = torch.Generator().manual_seed(0)
    q = torch.randn(16, 9, 78, 64, generator=gen).bfloat16().requires_grad_()
    k = torch.randn(16, 3, 78, 64, generator=gen).bfloat16().requires_grad_()
    v = torch.randn(16, 3, 78, 64, generator=gen).bfloat16().requires_grad_()
    pad = torch.randint(0, 20, (16,), generator=gen)
    position = torch.arange(78)
    real = position[None, :] >= pad[:, None]
    visible = ((position[:, None] >= position[None, :])[None] & real[:, None, :])[:, None]
    module = SimpleNamespace(num_key_value_groups=3, is_causal=True, training=True)
    out = {}
    for name, fn in (("short", short_attention.sdpa_or_short), ("flash", sdpa_attention_forward)):
        times = []
        for i in range(rounds * 5 + 3):
            start = time.perf_counter()
            fn(module, q, k, v, visible, scaling=0.125)[0].float().sum().backward()
            if i >= 3:
                times.append(time.perf_counter() - start)
        out[name] = 1000 * statistics.median(times)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()

    import torch

    from skyrl_core.config.schema import ModelConfig, TrainerConfig
    from skyrl_core.models import prepare_smollm2
    from skyrl_core.ops import short_attention
    from skyrl_core.testing.backend_contract import make_batch, mean_logprob_loss, random_sequences
    from skyrl_fsdp.backend import FSDPBackend
    from skyrl_fsdp.options import FSDPOptions

    print("load before:", uptime(), flush=True)
    torch.set_num_threads(args.threads)
    call = isolated(args.rounds)
    print(f"one call, forward + backward, [16, 9, 78, 64] bf16: short {call['short']:.1f} ms, flash {call['flash']:.1f} ms, "
          f"short / flash {call['short'] / call['flash']:.3f}x", flush=True)

    rng = random.Random(0)
    prompts = tuple(rng.randint(40, 50) for _ in range(64))
    responses = tuple(rng.randint(5, 32) for _ in range(64))
    batch = make_batch(*random_sequences(prompts, responses, vocab_size=49152))
    model = ModelConfig(path=str(prepare_smollm2()), dtype="bfloat16")
    limits = {"short": short_attention.MAX_SCORES, "flash": 0}
    backends = {name: FSDPBackend(model, FSDPOptions(device="cpu", mixed_precision="bf16"),
                                  trainer=TrainerConfig(lr=1e-6, micro_batch_size=16)) for name in limits}
    times: dict[str, list[float]] = {name: [] for name in limits}
    for round_index in range(args.rounds + 1):
        for name, backend in backends.items():
            short_attention.MAX_SCORES = limits[name]
            start = time.perf_counter()
            backend.forward_backward(batch, mean_logprob_loss)
            backend.optim_step()
            seconds = time.perf_counter() - start
            if round_index:
                times[name].append(seconds)
            print(f"round {round_index}{' (warm-up)' if not round_index else ''} {name}: {seconds:.2f} s", flush=True)
    short_attention.MAX_SCORES = limits["short"]
    short, flash = statistics.median(times["short"]), statistics.median(times["flash"])
    print(f"forward_backward + optim_step, median: short {short:.2f} s, flash {flash:.2f} s; short / flash {short / flash:.3f}x")
    print("load after:", uptime())
    print(machine())
    for backend in backends.values():
        backend.close()


if __name__ == "__main__":
    main()
