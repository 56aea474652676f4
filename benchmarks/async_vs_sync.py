"""RL throughput by ``trainer.mode``: sync vs one_step_off vs fully_async, the same work, alternating, in one run.

The work (every setting is printed with the result): SmolLM2-135M-Instruct (fp32, FSDP2 backend
with one in-process rank, skyrl-torch engine), GRPO, ``--prompts`` prompts x ``--samples`` samples
per step, ``--steps`` steps. An episode is an agent with ``--tool-calls`` tool calls: the model
writes a turn (up to ``--max-new-tokens`` tokens), the tool answers after a long-tailed latency
(``SlowToolEnv``: log-normal, median ``--latency-median-s``, sigma ``--latency-sigma``, cut at
the tool's timeout ``--latency-cap-s``), and so on; the last turn is rewarded. Tool calls of the
episodes in flight overlap in every mode (``rollout.env_workers``), so the modes differ only in
how generation and training wait for each other:

- ``sync``: a step generates its batch (all episodes' turns in lockstep: a turn waits for its
  slowest tool call), then trains, then syncs weights;
- ``one_step_off``: step k+1's batch is generated while step k trains;
- ``fully_async``: ``max_inflight`` = ``--inflight-steps`` steps' trajectories in flight, whole
  groups, ``max_staleness`` ``--max-staleness``; the trainer takes the first completed groups.

Where generation runs: ``colocated`` (in the trainer's process) or ``@separate`` (a mode written
``fully_async@separate``: the engine is a Ray actor process of its own, weights by gloo broadcast).
Threads: the trainer uses ``--threads``; a sync run's generation the same (nothing runs beside it);
generation beside training (the async modes) uses ``--async-generation-threads`` while the trainer
computes (engine option ``threads_beside_training``: two OpenMP teams of all the cores each,
time-sliced, wait at every barrier for a thread that is not running) and ``--threads`` while it
waits; a separate engine uses ``--async-generation-threads`` all the time. ``--sync-generation-threads``
runs sync's generation at another count (a control for what the thread count alone changes).

Each mode's throughput: trained samples over the summed step times (model loading excluded; step 1
included, so the async modes pay for filling their pipeline). The modes run one after another,
``--rounds`` times, each in a fresh child process, so that a busy machine slows all alike; medians
are reported. Per mode, a timeline (means per step): the trainer's time in rollouts (waiting, in
the async modes), training, weight sync; the generator's wait; the wall time during which a tool
call was pending; and the CPU the run used (trainer process plus a separate engine's) over the
cores, steps 2..N. Sync's idle share bounds what any overlap can gain on these cores: the
"ceiling" printed beside the ratios is sync's step time over its time with the tool waits removed
(and over its CPU time / cores).

Then the weight-sync bandwidth for SmolLM2 (GB/s of fp32 weights) into a torch engine, three ways:
in-process tensors (the colocated engine's ``update_weights``), a broadcast over a gloo pair on
loopback (``skyrl_core.weight_sync``; the receiving rank is a thread here) and a safetensors
checkpoint written and loaded; and this machine's GEMM roofline for one step's work
(``benchmarks/_roofline.py``). The last line: samples/s per mode and the ratios to sync (target:
fully_async >= 1.5x sync) beside the ceiling.

    python benchmarks/async_vs_sync.py [--rounds 2] [--steps 5] [--modes sync,one_step_off,fully_async]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import resource
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any

from skyrl_core import weight_sync
from skyrl_core.plugins import hookimpl
from skyrl_core.plugins.records import EnvironmentSpec
from skyrl_core.types import StepResult

MODES = ("sync", "one_step_off", "fully_async", "fully_async@separate")
SMOLLM2 = os.path.expanduser("~/.cache/skyrl/models/SmolLM2-135M-Instruct")
TOOL_RESULT = "Tool result: 42."
FINAL_ASK = "Now answer with a number."
# (start, end) of every tool call in this process (perf_counter): the wall time a tool was pending
TOOL_CALLS: list[tuple[float, float]] = []
_TOOL_LOCK = threading.Lock()


class SlowToolEnv:
    """An agent episode: ``tool_calls`` tool calls, each answered after a log-normal latency
    (median ``latency_median_s``, cut at ``latency_cap_s``), then a final answer; reward: the share
    of digits in the final answer (dense, so GRPO has signal)."""

    def __init__(self, latency_median_s: float = 1.0, latency_sigma: float = 1.0, latency_cap_s: float = 30.0,
                 tool_calls: int = 3, seed: int | None = None) -> None:
        self.median, self.sigma, self.cap, self.tool_calls = latency_median_s, latency_sigma, latency_cap_s, tool_calls
        self.rng = random.Random(seed)
        self.turn = 0

    def reset(self, sample: dict[str, Any]) -> list[dict[str, str]]:
        self.turn = 0
        return [dict(m) for m in sample["prompt"]]

    def step(self, action_text: str) -> StepResult:
        self.turn += 1
        if self.turn <= self.tool_calls:
            started = time.perf_counter()
            time.sleep(min(self.cap, self.median * math.exp(self.sigma * self.rng.gauss(0.0, 1.0))))
            with _TOOL_LOCK:
                TOOL_CALLS.append((started, time.perf_counter()))
            ask = FINAL_ASK if self.turn == self.tool_calls else "Call the tool again."
            return StepResult([{"role": "user", "content": f"{TOOL_RESULT} {ask}"}], 0.0, False, {})
        reward = sum(c.isdigit() for c in action_text) / max(1, len(action_text))
        return StepResult([], reward, True, {"correct": reward >= 0.5})


class _StepClock:
    """At each step's end: wall time, this process's CPU seconds and a separate engine's."""

    def __init__(self) -> None:
        self.marks: list[tuple[float, float, float]] = []
        self._engine_pids: list[int] | None = None

    def _engine_cpu(self) -> float:
        """CPU seconds of the run's separate engine processes (Ray actors), 0 when colocated."""
        import ray
        import ray.util

        if not ray.is_initialized():
            return 0.0
        if self._engine_pids is None:
            names = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True) if a["name"].startswith("skyrl-engine")]
            self._engine_pids = [ray.get(ray.get_actor(n).pid.remote()) for n in names]
        total = 0.0
        for pid in self._engine_pids:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            total += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime
        return total

    @hookimpl
    def skyrl_on_step_end(self, step: int, metrics: dict[str, float]) -> None:
        usage = resource.getrusage(resource.RUSAGE_SELF)
        self.marks.append((time.perf_counter(), usage.ru_utime + usage.ru_stime, self._engine_cpu()))


class _Plugin:
    @hookimpl
    def skyrl_register_environments(self, register) -> None:
        register(EnvironmentSpec(name="slow_tool", factory="async_vs_sync:SlowToolEnv"))


def split_mode(spec: str) -> tuple[str, str]:
    """``fully_async@separate`` -> (``fully_async``, ``separate``); a bare mode is colocated."""
    mode, _, placement = spec.partition("@")
    return mode, placement or "colocated"


def _config(workdir: str, spec: str, args: argparse.Namespace) -> dict[str, Any]:
    from skyrl_core.data import write_jsonl

    mode, placement = split_mode(spec)
    rows = [{"prompt": [{"role": "user", "content": f"Task {i}: add {i} and {2 * i + 3}, using the tool."}],
             "env_class": "slow_tool", "reward_spec": {}, "extra_info": {}} for i in range(64)]
    write_jsonl(rows, os.path.join(workdir, "train.jsonl"))
    per_step = args.prompts * args.samples
    engine: dict[str, Any] = {"name": "torch", "placement": placement}
    if placement == "separate":  # its own process: its own threads, all the time
        engine["options"] = {"threads": args.async_generation_threads}
    elif mode != "sync":  # beside training while the trainer computes, all the cores while it waits
        engine["options"] = {"threads_beside_training": args.async_generation_threads}
    elif args.sync_generation_threads is not None:  # (a control: sync's generation at another count)
        engine["options"] = {"threads": args.sync_generation_threads}
    return {
        "model": {"path": SMOLLM2},
        "engine": engine,
        "environment": {"name": "slow_tool", "options": {
            "latency_median_s": args.latency_median_s, "latency_sigma": args.latency_sigma,
            "latency_cap_s": args.latency_cap_s, "tool_calls": args.tool_calls}},
        "data": {"train": os.path.join(workdir, "train.jsonl"), "prompts_per_step": args.prompts},
        "generation": {"max_new_tokens": args.max_new_tokens, "n_samples": args.samples},
        "rollout": {"max_turns": args.tool_calls + 1, "env_workers": per_step * args.inflight_steps},
        "trainer": {"mode": mode, "steps": args.steps, "lr": 1e-6, "mini_batches": 1, "micro_batch_size": 8,
                    "plot": False, "progress": False, "output_dir": os.path.join(workdir, "run"),
                    "fully_async": {"max_inflight": args.inflight_steps * per_step, "max_staleness": args.max_staleness}},
    }


def _union_seconds(intervals: list[tuple[float, float]], start: float, end: float) -> float:
    """Wall time within [start, end] covered by at least one interval."""
    total, reach = 0.0, start
    for a, b in sorted(intervals):
        a, b = max(a, reach), min(b, end)
        if b > a:
            total += b - a
            reach = b
    return total


def run_mode(spec: str, args: argparse.Namespace) -> dict[str, Any]:
    """In this (child) process: train ``args.steps`` steps as ``spec`` says; samples/s and a timeline."""
    import torch

    from skyrl_core.config.loader import structure_config
    from skyrl_core.plugins.manager import get_plugin_manager
    from skyrl_core.trainer.metrics import read_metrics
    from skyrl_core.trainer.rl import train

    sys.modules.setdefault("async_vs_sync", sys.modules["__main__"])  # the env's factory: this module, one TOOL_CALLS
    torch.set_num_threads(args.threads)
    pm = get_plugin_manager()
    pm.register_plugin(_Plugin(), "bench-envs")
    clock = _StepClock()
    pm.register_plugin(clock, "bench-clock")
    with tempfile.TemporaryDirectory() as workdir:
        cfg = structure_config(_config(workdir, spec, args), plugin_manager=pm)
        records = [r for r in read_metrics(train(cfg, plugin_manager=pm).run_dir) if r["step"] > 0]
    steps = len(records)
    seconds = sum(r["time/step"] for r in records)
    per_step = args.prompts * args.samples

    def mean(key: str) -> float:
        return sum(r.get(key, 0.0) for r in records) / steps

    # steps 2..N (from step 1's end to the last step's end): tool-pending time and CPU use
    (t0, cpu0, engine0), (t1, cpu1, engine1) = clock.marks[0], clock.marks[-1]
    window = t1 - t0
    return {
        "samples_per_s": per_step * steps / seconds, "seconds": seconds,
        "steady_samples_per_s": per_step * (steps - 1) / sum(r["time/step"] for r in records[1:]),
        "step": seconds / steps, "rollout": mean("time/rollout"), "train": mean("time/train"),
        "old_logprobs": mean("time/old_logprobs"), "weight_sync": mean("time/weight_sync"),
        "trainer_wait": mean("time/trainer_wait"), "generator_wait": mean("time/generator_wait"),
        "steady_step": window / (steps - 1), "tool_pending": _union_seconds(TOOL_CALLS, t0, t1) / (steps - 1),
        "cpu_share": ((cpu1 - cpu0) + (engine1 - engine0)) / (window * (os.cpu_count() or 1)),
        "staleness_max": max(r.get("async/staleness_max", 0.0) for r in records),
        "staleness_mean": mean("async/staleness_mean"),
        "dropped": sum(r.get("async/dropped", 0.0) for r in records),
        "response_tokens": mean("response_length/mean"), "turns": mean("turns/mean"),
    }


def weight_sync_bandwidth(args: argparse.Namespace) -> dict[str, float]:
    """GB/s of SmolLM2's fp32 weights into a torch engine: in-process tensors, gloo broadcast, checkpoint."""
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

    host = weight_sync.GlooPairHost("127.0.0.1")
    joined: dict[str, Any] = {}
    joining = threading.Thread(target=lambda: joined.update(group=weight_sync.join_gloo_pair("127.0.0.1", host.port)))
    joining.start()
    sender = host.group()
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


def step_roofline(args: argparse.Namespace, response_tokens: float) -> Any:
    """The measured GEMM roofline of one step's work: sampling (prompt and tool results prefilled once,
    ``response_tokens`` per episode decoded at the step's batch) and training (forward and backward
    over the episodes, logits on the model's tokens)."""
    from _roofline import Roofline, decoder_gemms, generation_gemms
    from skyrl_core.config.schema import ModelConfig
    from skyrl_core.models import load_tokenizer
    from skyrl_core.rollout import ChatCodec

    with open(os.path.join(SMOLLM2, "config.json")) as f:
        config = json.load(f)
    codec = ChatCodec(load_tokenizer(ModelConfig(path=SMOLLM2)))
    prompt = len(codec.render_prompt([{"role": "user", "content": "Task 7: add 7 and 17, using the tool."}]))
    tool = len(codec.render_messages([{"role": "user", "content": f"{TOOL_RESULT} Call the tool again."}])) + 1
    episodes = args.prompts * args.samples
    context = args.prompts * prompt + episodes * args.tool_calls * tool
    generated = round(episodes * response_tokens)
    decode_steps = args.max_new_tokens * (args.tool_calls + 1)
    gemms = (generation_gemms(config, context, generated, episodes, decode_steps)
             + decoder_gemms(config, episodes * prompt + episodes * args.tool_calls * tool + generated, generated,
                             backward=True))
    return Roofline(gemms, threads=args.threads).measure(repeats=3)


def _child(what: str, args: argparse.Namespace) -> dict[str, Any] | None:
    """``what`` in a fresh process; None (its error printed) when it failed."""
    cmd = [sys.executable, os.path.abspath(__file__), "--child", what, *sys.argv[1:]]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
           "RAY_AUTH_MODE": "disabled"}
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=os.path.dirname(os.path.abspath(__file__)))
    if done.returncode != 0:
        print(f"{what} failed:\n{done.stderr[-3000:]}", flush=True)
        return None
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--modes", default=",".join(MODES), help="comma-separated; MODE@separate: engine in its own process")
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--prompts", type=int, default=2)
    parser.add_argument("--samples", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=16)
    parser.add_argument("--tool-calls", type=int, default=3)
    parser.add_argument("--latency-median-s", type=float, default=1.0)
    parser.add_argument("--latency-sigma", type=float, default=1.0)
    parser.add_argument("--latency-cap-s", type=float, default=30.0)
    parser.add_argument("--inflight-steps", type=int, default=2, help="fully_async: max_inflight in steps' trajectories")
    parser.add_argument("--max-staleness", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--async-generation-threads", type=int, default=1)
    parser.add_argument("--sync-generation-threads", type=int, default=None, help="default: --threads")
    parser.add_argument("--child", default=None)
    args = parser.parse_args()
    if args.child == "weight_sync":
        print(json.dumps(weight_sync_bandwidth(args)))
        return
    if args.child:
        print(json.dumps(run_mode(args.child, args)))
        return

    from _roofline import machine, uptime

    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    print(machine(), flush=True)
    per_step = args.prompts * args.samples
    print(f"settings: SmolLM2-135M-Instruct fp32, {args.prompts} prompts x {args.samples} samples = {per_step} episodes "
          f"a step, {args.steps} steps; {args.tool_calls} tool calls an episode ({args.tool_calls + 1} model turns of "
          f"<= {args.max_new_tokens} tokens), tool latency log-normal median {args.latency_median_s} s sigma "
          f"{args.latency_sigma} capped at {args.latency_cap_s} s; fully_async max_inflight "
          f"{args.inflight_steps * per_step}, max_staleness {args.max_staleness}; threads: trainer {args.threads}, "
          f"sync generation {args.sync_generation_threads or args.threads}, generation beside training {args.async_generation_threads} while the trainer computes ({args.threads} while it waits), separate engine {args.async_generation_threads}", flush=True)
    results: dict[str, list[dict[str, Any]]] = {m: [] for m in modes}
    for round_ in range(args.rounds):
        for mode in modes:
            r = _child(mode, args)
            if r is None:
                continue
            results[mode].append(r)
            print(f"round {round_ + 1} {mode:>20}: {r['samples_per_s']:.3f} samples/s ({r['seconds']:.1f} s; steps 2..N "
                  f"{r['steady_samples_per_s']:.3f}); per step: {r['step']:.1f} s = rollout/wait {r['rollout']:.1f} + "
                  f"train {r['train']:.1f} + weight sync {r['weight_sync']:.2f} (+ rest); generator waited "
                  f"{r['generator_wait']:.1f} s; a tool pending {r['tool_pending']:.1f} s; CPU used {r['cpu_share']:.0%} "
                  f"of the cores; staleness mean {r['staleness_mean']:.2f} max {r['staleness_max']:.0f}, dropped "
                  f"{r['dropped']:.0f}; {r['turns']:.1f} turns, {r['response_tokens']:.0f} model tokens an episode",
                  flush=True)
    results = {m: rs for m, rs in results.items() if rs}
    modes = list(results)
    sync = _child("weight_sync", args) or {"gigabytes": float("nan"), "in_process_tensors": float("nan"),
                                            "broadcast": float("nan"), "checkpoint": float("nan")}
    print(f"weight sync, SmolLM2 fp32 ({sync['gigabytes']:.2f} GB): in-process tensors {sync['in_process_tensors']:.2f} GB/s, "
          f"gloo broadcast {sync['broadcast']:.2f} GB/s, checkpoint (safetensors write + load) {sync['checkpoint']:.2f} GB/s")
    median = {m: statistics.median(r["samples_per_s"] for r in results[m]) for m in modes}
    tokens = statistics.mean(r["response_tokens"] for rs in results.values() for r in rs)
    roofline = step_roofline(args, tokens)
    print(f"load: {uptime()}")
    print(f"one step's GEMM work ({tokens:.0f} model tokens an episode): {roofline.summary()}")
    for m in modes:
        print(roofline.achieved(f"{m:>20} step (median)", per_step / median[m], "float32"))
    line = " ".join(f"{m}={median[m]:.3f} samples/s" for m in modes)
    if "sync" in results:
        s = results["sync"]
        idle = statistics.median(r["steady_step"] / max(1e-9, r["steady_step"] - r["tool_pending"]) for r in s)
        busy = statistics.median(1 / max(1e-9, r["cpu_share"]) for r in s)
        line += " | " + " ".join(f"{m}/sync={median[m] / median['sync']:.2f}x" for m in modes if m != "sync")
        line += f" (target fully_async >= 1.5x; ceiling on these cores: {idle:.2f}x from sync's tool waits, {busy:.2f}x from its CPU use)"
    print(line)


if __name__ == "__main__":
    main()
