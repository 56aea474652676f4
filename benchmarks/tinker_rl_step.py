"""One RL step through the Tinker API: ``skyrl tinker serve`` driven by the official ``tinker`` SDK.

The client loop a Tinker user writes (``skyrl_tinker.client_loops.rl_step``): 8 prompts x 8 samples,
up to 32 new tokens at temperature 1, a LoRA adapter of rank 8 (attention and MLP), group-centred
advantages, one ``forward_backward`` with ``importance_sampling``, one ``optim_step``, then
``save_weights_and_get_sampling_client`` for the next step. A step's time is the client's wall time
for all of that, printed with where it went (``sample``: all samples back; ``train``:
``forward_backward`` and ``optim_step`` back; ``save``: the next sampling client ready). The first
``--warmup`` steps are not counted.

Two base models, each served by a fresh server process: the tiny random Qwen3 of the tests
(``TINY_QWEN3``) and SmolLM2-135M-Instruct (fp32, ``skyrl_core.models.prepare_smollm2``). The
server's peak resident memory is its ``VmHWM`` at the end.

The peer: SkyRL 0.4's own Tinker server (JAX backend) measured on this machine with the same loop,
as the issue records it: 1.13 s/step (tiny), 86 s/step (SmolLM2), 18 GiB peak. The last lines
print skyrl's numbers and their ratios to the peer's (skyrl / peer: below 1 is faster / smaller).

    python benchmarks/tinker_rl_step.py [--steps 3] [--warmup 1] [--threads 2] [--only tiny|smollm2]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

PEER = {"tiny": {"s_per_step": 1.13}, "smollm2": {"s_per_step": 86.0, "peak_gib": 18.0}}


def peak_rss_gib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 2**20
    raise RuntimeError("no VmHWM in /proc status")


def run(name: str, model_dir: str, encode, workdir: Path, args: argparse.Namespace) -> dict[str, float]:
    import tinker

    from skyrl_tinker.client_loops import arithmetic_prompts, rl_step
    from skyrl_tinker.launch import serve_subprocess

    checkpoints = workdir / f"ck-{name}"
    checkpoints.mkdir()
    env = {"OMP_NUM_THREADS": str(args.threads)}
    with serve_subprocess(model_dir, checkpoints, model_name=name, env=env) as (url, proc):
        service = tinker.ServiceClient(base_url=url, api_key="tml-benchmark")
        tc = service.create_lora_training_client(base_model=name, rank=8, seed=0, train_unembed=False).result()
        sampler = tc.save_weights_and_get_sampling_client().result()
        prompts = arithmetic_prompts(encode, 8)
        times, rewards, phases = [], [], []
        for step in range(args.warmup + args.steps):
            start = time.perf_counter()
            timings: dict[str, float] = {}
            reward, sampler = rl_step(tc, sampler, prompts, samples=8, max_tokens=32, learning_rate=1e-4, seed=step, timings=timings)
            elapsed = time.perf_counter() - start
            rewards.append(reward)
            if step >= args.warmup:
                times.append(elapsed)
                phases.append(timings)
            where = ", ".join(f"{k} {v:.2f}" for k, v in timings.items())
            print(f"{name}: step {step} {elapsed:.2f} s ({where}){' (warm-up)' if step < args.warmup else ''}, reward {reward:.3f}", flush=True)
        peak = peak_rss_gib(proc.pid)
    medians = {k: statistics.median(p[k] for p in phases) for k in phases[0]}
    print(f"{name}: median s/step {statistics.median(times):.3f} = " + " + ".join(f"{k} {v:.3f}" for k, v in medians.items()), flush=True)
    return {"s_per_step": statistics.median(times), "peak_gib": peak}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--only", choices=("tiny", "smollm2"), default=None)
    args = parser.parse_args()

    from skyrl_core.models import prepare_smollm2
    from skyrl_core.testing.backend_contract import TINY_QWEN3
    from skyrl_tinker.launch import byte_tokenizer, write_model_dir

    results: dict[str, dict[str, float]] = {}
    with tempfile.TemporaryDirectory(prefix="tinker-bench-") as tmp:
        workdir = Path(tmp)
        if args.only in (None, "tiny"):
            tiny = write_model_dir(workdir / "tiny-qwen3", TINY_QWEN3)
            results["tiny"] = run("tiny", tiny, byte_tokenizer().encode, workdir, args)
        if args.only in (None, "smollm2"):
            from transformers import AutoTokenizer

            smollm2 = prepare_smollm2()
            tokenizer = AutoTokenizer.from_pretrained(smollm2)
            results["smollm2"] = run("smollm2", smollm2, lambda s: tokenizer.encode(s, add_special_tokens=False), workdir, args)

    print()
    print(f"{'model':<9} {'skyrl s/step':>13} {'peer s/step':>12} {'ratio':>7} {'skyrl peak GiB':>15} {'peer peak GiB':>14} {'ratio':>7}")
    for name, ours in results.items():
        peer = PEER[name]
        peak_peer = peer.get("peak_gib")
        peak_ratio = f"{ours['peak_gib'] / peak_peer:7.3f}" if peak_peer else f"{'-':>7}"
        print(
            f"{name:<9} {ours['s_per_step']:13.3f} {peer['s_per_step']:12.2f} {ours['s_per_step'] / peer['s_per_step']:7.3f} "
            f"{ours['peak_gib']:15.2f} {peak_peer or '-':>14} {peak_ratio}"
        )


if __name__ == "__main__":
    main()
