"""RL throughput by ``trainer.mode``: sync vs one_step_off vs fully_async, the same work, alternating, in one run.

The work: SmolLM2-135M-Instruct (fp32, skyrl-torch engine in the trainer's process, FSDP2 backend
with one in-process rank), GRPO, ``--prompts`` prompts x ``--samples`` samples per step, ``--steps``
steps, two model turns per episode with a tool call between them whose latency is long-tailed
(``SlowToolEnv``'s option ``latency_median_s``, log-normal with ``latency_sigma``, capped at
``latency_cap_s``). Environment steps of one batch overlap in every mode (``rollout.env_workers``),
so the modes differ only in how generation and training wait for each other. ``fully_async`` runs
with ``max_staleness`` 2 and ``max_inflight`` = one step's trajectories x 2.

Each mode's throughput is the trained samples over the summed step times (model loading excluded).
The modes run one after another, ``--rounds`` times (sync, one_step_off, fully_async, sync, ...),
each in a fresh child process, so that a busy machine slows all alike; medians are reported.

Then the weight-sync bandwidth for SmolLM2 (GB/s of fp32 weights) into a torch engine, three ways:
in-process tensors (the colocated engine's ``update_weights``), a broadcast over a gloo pair on
loopback (``skyrl_core.weight_sync``; the receiving rank is a thread here) and a safetensors
checkpoint written and loaded. The last line: samples/s per mode and the ratios to sync
(target: fully_async >= 1.5x sync).

    python benchmarks/async_vs_sync.py [--rounds 1] [--steps 4] [--latency-median-s 1.0]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any

from skyrl_core import weight_sync
from skyrl_core.backends.ray_actors import free_port
from skyrl_core.plugins import hookimpl
from skyrl_core.plugins.records import EnvironmentSpec
from skyrl_core.types import StepResult

MODES = ("sync", "one_step_off", "fully_async")
SMOLLM2 = os.path.expanduser("~/.cache/skyrl/models/SmolLM2-135M-Instruct")


class SlowToolEnv:
    """Two model turns with a tool call between them that takes a log-normal time (median
    ``latency_median_s``); reward: the share of digits in the final answer (dense, so GRPO has signal)."""

    def __init__(self, latency_median_s: float = 1.0, latency_sigma: float = 1.0, latency_cap_s: float = 8.0,
                 seed: int | None = None) -> None:
        self.median, self.sigma, self.cap = latency_median_s, latency_sigma, latency_cap_s
        self.rng = random.Random(seed)
        self.turn = 0

    def reset(self, sample: dict[str, Any]) -> list[dict[str, str]]:
        self.turn = 0
        return [dict(m) for m in sample["prompt"]]

    def step(self, action_text: str) -> StepResult:
        self.turn += 1
        if self.turn == 1:
            time.sleep(min(self.cap, self.median * math.exp(self.sigma * self.rng.gauss(0.0, 1.0))))
            return StepResult([{"role": "user", "content": "Tool result: 42. Now answer with a number."}], 0.0, False, {})
        reward = sum(c.isdigit() for c in action_text) / max(1, len(action_text))
        return StepResult([], reward, True, {"correct": reward >= 0.5})


class _Plugin:
    @hookimpl
    def skyrl_register_environments(self, register) -> None:
        register(EnvironmentSpec(name="slow_tool", factory="async_vs_sync:SlowToolEnv"))


def _config(workdir: str, mode: str, args: argparse.Namespace) -> dict[str, Any]:
    from skyrl_core.data import write_jsonl

    rows = [{"prompt": [{"role": "user", "content": f"Task {i}: add {i} and {2 * i + 3}, using the tool."}],
             "env_class": "slow_tool", "reward_spec": {}, "extra_info": {}} for i in range(64)]
    write_jsonl(rows, os.path.join(workdir, "train.jsonl"))
    per_step = args.prompts * args.samples
    return {
        "model": {"path": SMOLLM2},
        "environment": {"name": "slow_tool", "options": {"latency_median_s": args.latency_median_s,
                                                          "latency_sigma": args.latency_sigma}},
        "data": {"train": os.path.join(workdir, "train.jsonl"), "prompts_per_step": args.prompts},
        "generation": {"max_new_tokens": args.max_new_tokens, "n_samples": args.samples},
        "rollout": {"max_turns": 2, "env_workers": per_step},
        "trainer": {"mode": mode, "steps": args.steps, "lr": 1e-6, "mini_batches": 1, "micro_batch_size": 8,
                    "plot": False, "progress": False, "output_dir": os.path.join(workdir, "run"),
                    "fully_async": {"max_inflight": 2 * per_step, "max_staleness": 2}},
    }


def run_mode(mode: str, args: argparse.Namespace) -> dict[str, float]:
    """In this (child) process: train ``args.steps`` steps in ``mode``; samples/s and wait times."""
    import torch

    from skyrl_core.config.loader import structure_config
    from skyrl_core.plugins.manager import get_plugin_manager
    from skyrl_core.trainer.metrics import read_metrics
    from skyrl_core.trainer.rl import train

    torch.set_num_threads(args.threads)
    pm = get_plugin_manager()
    pm.register_plugin(_Plugin(), "bench-envs")
    with tempfile.TemporaryDirectory() as workdir:
        cfg = structure_config(_config(workdir, mode, args), plugin_manager=pm)
        records = [r for r in read_metrics(train(cfg, plugin_manager=pm).run_dir) if r["step"] > 0]
    seconds = sum(r["time/step"] for r in records)
    samples = args.prompts * args.samples * len(records)
    return {"samples_per_s": samples / seconds, "seconds": seconds,
            "trainer_wait": sum(r.get("time/trainer_wait", 0.0) for r in records),
            "staleness_max": max(r.get("async/staleness_max", 0.0) for r in records),
            "dropped": sum(r.get("async/dropped", 0.0) for r in records)}


def weight_sync_bandwidth(args: argparse.Namespace) -> dict[str, float]:
    """GB/s of SmolLM2's fp32 weights into the colocated torch engine (in-process tensors)."""
    import torch

    from skyrl_core.config.schema import ModelConfig
    from skyrl_core.models import load_causal_lm
    from skyrl_torch.engine import TorchEngine

    torch.set_num_threads(args.threads)
    model = ModelConfig(path=SMOLLM2)
    source = load_causal_lm(model, seed=0)
    tensors = [(n, p.detach()) for n, p in source.named_parameters()]
    gigabytes = sum(t.numel() * t.element_size() for _, t in tensors) / 1e9
    engine = TorchEngine(model)

    def in_process() -> None:
        engine.update_weights(iter(tensors))

    def checkpoint() -> None:
        with tempfile.TemporaryDirectory() as directory:
            engine.update_weights(weight_sync.read_checkpoint(weight_sync.write_checkpoint(directory, tensors, 1)))

    port = free_port()
    joined: dict[str, Any] = {}
    joining = threading.Thread(target=lambda: joined.update(group=weight_sync.gloo_pair("127.0.0.1", port, rank=1)))
    joining.start()
    sender = weight_sync.gloo_pair("127.0.0.1", port, rank=0)
    joining.join()
    manifest = weight_sync.manifest_of(tensors)

    def broadcast() -> None:  # (the receiving side in a thread here; in use, the engine's process)
        receiving = threading.Thread(
            target=lambda: engine.update_weights(list(weight_sync.receive_by_broadcast(joined["group"], manifest))))
        receiving.start()
        weight_sync.send_by_broadcast(sender, tensors)
        receiving.join()

    out = {"gigabytes": gigabytes}
    for name, sync in (("in_process_tensors", in_process), ("broadcast", broadcast), ("checkpoint", checkpoint)):
        times = []
        for _ in range(3):
            started = time.perf_counter()
            sync()
            times.append(time.perf_counter() - started)
        out[name] = gigabytes / min(times)
    engine.close()
    return out


def _child(what: str, args: argparse.Namespace) -> dict[str, float]:
    cmd = [sys.executable, os.path.abspath(__file__), "--child", what, *sys.argv[1:]]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=os.path.dirname(os.path.abspath(__file__)))
    if done.returncode != 0:
        raise SystemExit(f"{what} failed:\n{done.stderr[-4000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--samples", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=24)
    parser.add_argument("--latency-median-s", type=float, default=1.0)
    parser.add_argument("--latency-sigma", type=float, default=1.0)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--child", default=None)
    args = parser.parse_args()
    if args.child == "weight_sync":
        print(json.dumps(weight_sync_bandwidth(args)))
        return
    if args.child:
        print(json.dumps(run_mode(args.child, args)))
        return

    results: dict[str, list[dict[str, float]]] = {m: [] for m in MODES}
    for round_ in range(args.rounds):
        for mode in MODES:
            r = _child(mode, args)
            results[mode].append(r)
            print(f"round {round_ + 1} {mode:>13}: {r['samples_per_s']:.3f} samples/s ({r['seconds']:.1f} s, "
                  f"trainer waited {r['trainer_wait']:.1f} s, staleness max {r['staleness_max']:.0f}, "
                  f"dropped {r['dropped']:.0f})", flush=True)
    sync = _child("weight_sync", args)
    print(f"weight sync, SmolLM2 fp32 ({sync['gigabytes']:.2f} GB): in-process tensors {sync['in_process_tensors']:.2f} GB/s, "
          f"gloo broadcast {sync['broadcast']:.2f} GB/s, checkpoint (safetensors write + load) {sync['checkpoint']:.2f} GB/s")
    median = {m: statistics.median(r["samples_per_s"] for r in results[m]) for m in MODES}
    print(" ".join(f"{m}={median[m]:.3f} samples/s" for m in MODES)
          + f" | one_step_off/sync={median['one_step_off'] / median['sync']:.2f}x"
          + f" fully_async/sync={median['fully_async'] / median['sync']:.2f}x (target >= 1.5x)")


if __name__ == "__main__":
    main()
