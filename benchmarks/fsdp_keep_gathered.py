"""The FSDP trainer's step with and without ``keep_gathered_params``, side by side in one run.

SmolLM2-135M-Instruct on the in-process FSDP backend (world size 1) in ``--dtype`` (bfloat16 by
default), a batch shaped like ``rl_step_vs_trl``'s (64 rows: prompts of 40-50 and responses of
8-32 random tokens), micro_batch_size 16, 2 threads. A step is what the RL trainer does with it:
the scoring ``forward``, ``forward_backward`` and ``optim_step``. Each setting runs in its own
child process, alternately (``--rounds`` times each), each child timing ``--steps`` steps after
one warm-up step; prints every step time, the medians and their ratio, and the load before/after.

    python benchmarks/fsdp_keep_gathered.py [--dtype bfloat16] [--rounds 2] [--steps 3] [--layers N]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

from _roofline import machine, uptime


def child(dtype: str, keep: bool, steps: int, threads: int, layers: int | None) -> None:
    import torch

    from skyrl_core.config.schema import ModelConfig, TrainerConfig
    from skyrl_core.models import prepare_smollm2
    from skyrl_core.testing.backend_contract import make_batch, mean_logprob_loss, random_sequences
    from skyrl_fsdp.backend import FSDPBackend
    from skyrl_fsdp.options import FSDPOptions

    torch.set_num_threads(threads)
    gen = torch.Generator().manual_seed(0)
    prompt_lengths = tuple(int(n) for n in torch.randint(40, 51, (64,), generator=gen))
    response_lengths = tuple(int(n) for n in torch.randint(8, 33, (64,), generator=gen))
    batch = make_batch(*random_sequences(prompt_lengths, response_lengths, vocab_size=49152))
    model = ModelConfig(path=prepare_smollm2(), dtype=dtype)
    if layers is not None:  # SmolLM2's shapes with fewer layers, random weights (a lighter check)
        config = json.loads(open(os.path.join(prepare_smollm2(), "config.json")).read())
        model = ModelConfig(config={**config, "num_hidden_layers": layers}, dtype=dtype)
    options = FSDPOptions(device="cpu", keep_gathered_params=keep)
    times = []
    with FSDPBackend(model, options, trainer=TrainerConfig(lr=1e-6, micro_batch_size=16)) as fsdp:
        for _ in range(steps + 1):
            start = time.perf_counter()
            fsdp.forward(batch)
            fsdp.forward_backward(batch, mean_logprob_loss)
            fsdp.optim_step()
            times.append(time.perf_counter() - start)
    print(json.dumps(times[1:]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--layers", type=int, help="SmolLM2's shapes with this many layers, random weights")
    parser.add_argument("--child", choices=("kept", "per_micro_batch"))
    args = parser.parse_args()
    if args.child:
        child(args.dtype, args.child == "kept", args.steps, args.threads, args.layers)
        return
    print("load before:", uptime(), flush=True)
    times: dict[str, list[float]] = {"per_micro_batch": [], "kept": []}
    for round_ in range(args.rounds):
        for name in times:
            out = subprocess.run(
                [sys.executable, __file__, "--child", name, "--dtype", args.dtype, "--steps", str(args.steps),
                 "--threads", str(args.threads), *(["--layers", str(args.layers)] if args.layers else [])],
                capture_output=True, text=True, check=True,
            ).stdout.strip().splitlines()[-1]
            step_times = json.loads(out)
            times[name] += step_times
            print(f"round {round_}: {name:15s} step times {[round(t, 2) for t in step_times]} s", flush=True)
    plain, kept = statistics.median(times["per_micro_batch"]), statistics.median(times["kept"])
    print(f"{args.dtype}: median step per_micro_batch {plain:.2f} s, kept {kept:.2f} s; per_micro_batch / kept {plain / kept:.2f}x")
    print("load after:", uptime())
    print(machine())


if __name__ == "__main__":
    main()
