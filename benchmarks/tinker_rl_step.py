"""One RL step through the Tinker API: ``skyrl tinker serve`` driven by the official ``tinker`` SDK.

The client loop a Tinker user writes (``skyrl_tinker.client_loops.rl_step``): 8 prompts x 8 samples,
up to 32 new tokens at temperature 1, a LoRA adapter of rank 8 (attention and MLP; ``--train-unembed``
also the unembedding, the SDK's default), group-centred
advantages, one ``forward_backward`` with ``importance_sampling``, one ``optim_step``, then
``save_weights_and_get_sampling_client`` for the next step. A step's time is the client's wall time
for all of that, printed with where it went (``sample``: all samples back; ``train``:
``forward_backward`` and ``optim_step`` back; ``save``: the next sampling client ready). The first
``--warmup`` steps are not counted.

Two base models, each served by a fresh server process: the tiny random Qwen3 of the tests
(``TINY_QWEN3``) and SmolLM2-135M-Instruct (fp32, ``skyrl_core.models.prepare_smollm2``). The
server's peak resident memory is its ``VmHWM`` at the end.

The server's resident memory (its process tree) is also sampled every ``--rss-interval`` seconds
(0.5 s) and charged to the client's phase at that moment: the peak of each phase (``setup``: start,
adapter, first sampling client) is printed after the steps. Sampling is not free: each sample walks
the process table from the client, on the cores the server's threads compute on; every 20 ms it
made SmolLM2's step 11-28% slower (two rounds side by side on 2026-12-02: 21.0 and 26.2 s against
19.0 and 20.5 s every 0.5 s). The overall peak, ``VmHWM``, is the kernel's own and exact whatever
the interval.

Beside the times: this machine's limit for the same work (``benchmarks/_roofline.py``, measured
after the steps): the GEMM FLOPs of one step (sampling: prefill and one decode step per token of
the longest sample; training: the forward over every datum's positions and its input gradients,
the frozen base getting no weight gradients; LoRA's own small products left out), the fastest
measured fp32 rate at each shape, and the fraction of that peak a median step reached. The CPU and
the GEMM libraries are printed first.

The peer: SkyRL 0.4's own Tinker server (JAX backend) measured on this machine with the same loop,
as the issue records it: 1.13 s/step (tiny), 86 s/step (SmolLM2), 18 GiB peak. The last lines
print skyrl's numbers and their ratios to the peer's (skyrl / peer: below 1 is faster / smaller).

    python benchmarks/tinker_rl_step.py [--steps 3] [--warmup 1] [--threads 2] [--only tiny|smollm2] [--rss-interval 0.5]
                                        [--server-arg=--engine-option --server-arg=prepack_weights=false]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import threading
import time
from pathlib import Path

from _roofline import Gemm, Roofline, decoder_gemms, generation_gemms, machine, uptime

PEER = {"tiny": {"s_per_step": 1.13}, "smollm2": {"s_per_step": 86.0, "peak_gib": 18.0}}


def peak_rss_gib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 2**20
    raise RuntimeError("no VmHWM in /proc status")


class PhaseMemory:
    """Resident bytes of a process tree sampled every ``interval`` seconds in a thread; ``peaks``
    charges each sample to the phase whose interval holds it."""

    def __init__(self, pid: int, interval: float = 0.5) -> None:
        import psutil

        self.process = psutil.Process(pid)
        self.interval = interval
        self.samples: list[tuple[float, int]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, name="rss-sampler", daemon=True)
        self._thread.start()

    def _sample(self) -> None:
        import psutil

        while not self._stop.is_set():
            try:
                rss = self.process.memory_info().rss
                for child in self.process.children(recursive=True):
                    try:
                        rss += child.memory_info().rss
                    except psutil.Error:  # exited between listing and reading
                        pass
            except psutil.Error:
                return
            self.samples.append((time.perf_counter(), rss))
            self._stop.wait(self.interval)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    def peaks(self, intervals: list[tuple[str, float, float]]) -> dict[str, float]:
        """Phase -> peak GiB over its ``(phase, start, end)`` intervals."""
        out: dict[str, float] = {}
        for phase, start, end in intervals:
            inside = [rss for t, rss in self.samples if start <= t < end]
            if inside:
                out[phase] = max(out.get(phase, 0.0), max(inside) / 2**30)
        return out


def step_gemms(model_dir: str, lengths: list[tuple[int, int]]) -> list[Gemm]:
    """The linear layers' products of one step with these ``(prompt, sampled)`` lengths (see the
    module's description)."""
    with open(Path(model_dir) / "config.json") as f:
        config = json.load(f)
    prompts = sum(p for p, _ in lengths)
    sampled = sum(n for _, n in lengths)
    longest = max(n for _, n in lengths)
    positions = sum(p + n - 1 for p, n in lengths if n)  # a datum is the sequence less its last token
    forward = decoder_gemms(config, positions, positions)
    input_gradients = [Gemm(g.rows, g.cols, g.inner, g.count) for g in forward]
    return generation_gemms(config, prompts, sampled, len(lengths), longest) + forward + input_gradients


def run(name: str, model_dir: str, encode, workdir: Path, args: argparse.Namespace, dtype: str) -> dict[str, float]:
    import tinker

    from skyrl_tinker.client_loops import arithmetic_prompts, rl_step
    from skyrl_tinker.launch import serve_subprocess

    checkpoints = workdir / f"ck-{name}-{dtype}"
    checkpoints.mkdir()
    label = f"{name} {dtype}"
    env = {"OMP_NUM_THREADS": str(args.threads)}
    intervals: list[tuple[str, float, float]] = []
    with serve_subprocess(model_dir, checkpoints, model_name=name, env=env, extra=("--dtype", dtype, *args.server_arg)) as (url, proc):
        memory = PhaseMemory(proc.pid, interval=args.rss_interval)
        setup = time.perf_counter()
        # (closing the client finishes its session and stops the SDK's heartbeat thread)
        with tinker.ServiceClient(base_url=url, api_key="tml-benchmark") as service:
            tc = service.create_lora_training_client(base_model=name, rank=8, seed=0, train_unembed=args.train_unembed).result()
            sampler = tc.save_weights_and_get_sampling_client().result()
            intervals.append(("setup", setup, time.perf_counter()))
            prompts = arithmetic_prompts(encode, 8)
            times, phases, lengths = [], [], []
            for step in range(args.warmup + args.steps):
                start = time.perf_counter()
                timings: dict[str, float] = {}
                step_lengths: list[tuple[int, int]] = []
                reward, sampler = rl_step(tc, sampler, prompts, samples=8, max_tokens=32, learning_rate=1e-4, seed=step,
                                          timings=timings, lengths=step_lengths)
                elapsed = time.perf_counter() - start
                edge = start
                for phase, seconds in timings.items():
                    intervals.append((phase, edge, edge + seconds))
                    edge += seconds
                if step >= args.warmup:
                    times.append(elapsed)
                    phases.append(timings)
                    lengths.append(step_lengths)
                where = ", ".join(f"{k} {v:.2f}" for k, v in timings.items())
                print(f"{label}: step {step} {elapsed:.2f} s ({where}){' (warm-up)' if step < args.warmup else ''}, reward {reward:.3f}", flush=True)
        memory.stop()
        peak = peak_rss_gib(proc.pid)
    medians = {k: statistics.median(p[k] for p in phases) for k in phases[0]}
    median = statistics.median(times)
    print(f"{label}: median s/step {median:.3f} = " + " + ".join(f"{k} {v:.3f}" for k, v in medians.items()), flush=True)
    print(f"{label}: server peak resident GiB by phase: "
          + ", ".join(f"{k} {v:.2f}" for k, v in memory.peaks(intervals).items()) + f"; VmHWM {peak:.2f}", flush=True)
    # The work of the step whose time is the median (its own sampled lengths).
    median_step = min(range(len(times)), key=lambda i: abs(times[i] - median))
    roofline = Roofline(step_gemms(model_dir, lengths[median_step]), threads=args.threads, dtypes=(dtype,)).measure(repeats=3)
    print(f"{label}: {roofline.summary()}", flush=True)
    print(f"{label}: " + roofline.achieved("median step", median, dtype), flush=True)
    return {"s_per_step": median, "peak_gib": peak}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--only", choices=("tiny", "smollm2"), default=None)
    parser.add_argument("--dtype", choices=("float32", "bfloat16", "both"), default="float32",
                        help="the served base model's dtype (`skyrl tinker serve --dtype`); both: a float32 server, then a bfloat16 one")
    parser.add_argument("--rss-interval", type=float, default=0.5,
                        help="seconds between samples of the server's resident memory (each costs client CPU beside the server's threads)")
    parser.add_argument("--train-unembed", action="store_true",
                        help="the adapter also on the unembedding, as the SDK's default has it (both models tie it to the "
                             "embedding: lm_head is then merged alone); off: attention and MLP, as the figures on record")
    parser.add_argument("--server-arg", action="append", default=[], metavar="ARG",
                        help="an argument added to `skyrl tinker serve` (repeatable; write --server-arg=--engine-option)")
    args = parser.parse_args()
    print(machine(), flush=True)
    if args.server_arg:
        print(f"server arguments: {' '.join(args.server_arg)}", flush=True)

    from skyrl_core.models import prepare_smollm2
    from skyrl_core.testing.backend_contract import TINY_QWEN3
    from skyrl_tinker.launch import byte_tokenizer, write_model_dir

    dtypes = ("float32", "bfloat16") if args.dtype == "both" else (args.dtype,)
    results: dict[tuple[str, str], dict[str, float]] = {}
    with tempfile.TemporaryDirectory(prefix="tinker-bench-") as tmp:
        workdir = Path(tmp)
        if args.only in (None, "tiny"):
            tiny = write_model_dir(workdir / "tiny-qwen3", TINY_QWEN3)
            for dtype in dtypes:
                results["tiny", dtype] = run("tiny", tiny, byte_tokenizer().encode, workdir, args, dtype)
        if args.only in (None, "smollm2"):
            from transformers import AutoTokenizer

            smollm2 = prepare_smollm2()
            tokenizer = AutoTokenizer.from_pretrained(smollm2)
            for dtype in dtypes:
                results["smollm2", dtype] = run("smollm2", smollm2, lambda s: tokenizer.encode(s, add_special_tokens=False), workdir, args, dtype)

    print()
    print(f"{'model':<9} {'dtype':<9} {'skyrl s/step':>13} {'peer s/step':>12} {'ratio':>7} {'skyrl peak GiB':>15} {'peer peak GiB':>14} {'ratio':>7}")
    for (name, dtype), ours in results.items():
        peer = PEER[name]
        peak_peer = peer.get("peak_gib")
        peak_ratio = f"{ours['peak_gib'] / peak_peer:7.3f}" if peak_peer else f"{'-':>7}"
        print(
            f"{name:<9} {dtype:<9} {ours['s_per_step']:13.3f} {peer['s_per_step']:12.2f} {ours['s_per_step'] / peer['s_per_step']:7.3f} "
            f"{ours['peak_gib']:15.2f} {peak_peer or '-':>14} {peak_ratio}"
        )
    print(f"load at the end: {uptime()}")


if __name__ == "__main__":
    main()
