"""Peak resident memory of a whole ``skyrl train`` run (this process and every child it starts), by
phase of the loop.

The run goes in this process (``skyrl_core.trainer.rl.train``, what ``skyrl train`` runs) while a
thread samples the resident set of the process tree (``psutil``, every ``--interval`` seconds) and
charges each sample to the phase the loop is in (the names of ``RunActivity``: setting up,
generating rollouts, computing old logprobs, training, syncing weights, ...). Printed: the peak of
each phase, the peak of the run, and ``ru_maxrss`` of this process and of its waited-for children
as a cross-check that sampling missed no spike.

    python benchmarks/memory_example.py examples/sql_multiturn.yaml --steps 2
    python benchmarks/memory_example.py examples/sql_multiturn.yaml --steps 2 trainer.micro_batch_tokens=2048

The run writes into a fresh temporary ``trainer.output_dir`` (removed afterwards) unless an
override sets it.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import resource
import shutil
import sys
import tempfile
import threading
import time
import warnings

GIB = 1024**3


def tree_rss() -> int:
    """Resident bytes of this process and all its descendants now."""
    import psutil

    me = psutil.Process()
    total = me.memory_info().rss
    for child in me.children(recursive=True):
        try:
            total += child.memory_info().rss
        except psutil.Error:  # exited between listing and reading
            pass
    return total


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]


def malloc_info() -> str:
    """glibc's view of this process's heap (``mallinfo2``, all arenas): bytes in use, free but kept,
    mmapped."""
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.mallinfo2.restype = _MallInfo2
        info = libc.mallinfo2()
    except (OSError, AttributeError):
        return "mallinfo2 unavailable"
    return (f"malloc in use {info.uordblks / GIB:.2f} GiB, free but kept {info.fordblks / GIB:.2f} GiB, "
            f"mmapped {info.hblkhd / GIB:.2f} GiB")


def heap_account() -> str:
    """glibc's view of this process's heap (``mallinfo2``): bytes in use, free but kept, mmapped;
    and the bytes of the tensors alive now (storages reachable from Python, each counted once)."""
    import gc

    import torch

    heap = malloc_info() + "; "
    storages: dict[int, int] = {}
    with warnings.catch_warnings():  # touching some module objects warns of deprecations
        warnings.simplefilter("ignore")
        objects = [obj for obj in gc.get_objects() if isinstance(obj, torch.Tensor)]
    for obj in objects:
        try:
            if obj.device.type == "cpu":
                local = getattr(obj, "_local_tensor", obj)  # a DTensor's shard
                storage = local.untyped_storage()
                storages[storage.data_ptr()] = storage.nbytes()
        except Exception:  # noqa: BLE001 - meta tensors, tensor subclasses without storage
            continue
    return heap + f"tensors alive {sum(storages.values()) / GIB:.2f} GiB"


class PhaseSampler:
    """Samples the tree's resident set on a thread; ``phase`` is set by the loop."""

    def __init__(self, interval: float, account: bool = False) -> None:
        self.interval = interval
        self.account = account
        self.at_peak = ""  # glibc's heap when the tree's resident set was highest
        self.phase = "setting up"
        self.peaks: dict[str, int] = {}
        self.order: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def set_phase(self, step: int, phase: str) -> None:
        self.sample()
        print(f"[memory] {self.peaks[self.phase] / GIB:.2f} GiB peak in: {self.phase}", file=sys.stderr, flush=True)
        if self.account:
            print(f"[memory] now {tree_rss() / GIB:.2f} GiB: {heap_account()}", file=sys.stderr, flush=True)
        self.phase = f"step {step}: {phase}" if step else phase

    def sample(self) -> None:
        rss = tree_rss()
        if self.phase not in self.peaks:
            self.order.append(self.phase)
        if self.account and rss > max(self.peaks.values(), default=0):
            self.at_peak = f"{rss / GIB:.2f} GiB in {self.phase}: {malloc_info()}"
        self.peaks[self.phase] = max(self.peaks.get(self.phase, 0), rss)

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self.sample()

    def __enter__(self) -> "PhaseSampler":
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.sample()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("config")
    parser.add_argument("overrides", nargs="*", help="dotted overrides, as for skyrl train")
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--interval", type=float, default=0.05, help="seconds between samples")
    parser.add_argument("--account", action="store_true",
                        help="at each phase change, also print glibc's heap use and the bytes of live tensors")
    args = parser.parse_args()
    for name, value in (("HF_HUB_OFFLINE", "1"), ("TRANSFORMERS_OFFLINE", "1"), ("TOKENIZERS_PARALLELISM", "false")):
        os.environ.setdefault(name, value)

    from skyrl_core.cli.main import _with_shorthands, load_config_or_exit
    from skyrl_core.trainer import failure, rl

    overrides = [f"trainer.steps={args.steps}", "trainer.progress=false", *args.overrides]
    scratch = None
    if not any(o.startswith("trainer.output_dir=") for o in overrides):
        scratch = tempfile.mkdtemp(prefix="skyrl-memory-")
        overrides.append(f"trainer.output_dir={scratch}/run")
    cfg = load_config_or_exit(args.config, _with_shorthands(overrides))

    sampler = PhaseSampler(args.interval, args.account)
    original_now = failure.RunActivity.now

    def now(self: failure.RunActivity, step: int, phase: str) -> None:
        sampler.set_phase(step, phase)
        original_now(self, step, phase)

    failure.RunActivity.now = now
    started = time.perf_counter()
    try:
        with sampler:
            rl.train(cfg)
    finally:
        failure.RunActivity.now = original_now
        if scratch:
            shutil.rmtree(scratch, ignore_errors=True)
    seconds = time.perf_counter() - started

    print(f"\npeak resident memory of the process tree by phase ({args.config}, {args.steps} steps, "
          f"{seconds:.0f} s, sampled every {args.interval} s):")
    for phase in sampler.order:
        print(f"  {sampler.peaks[phase] / GIB:6.2f} GiB  {phase}")
    peak = max(sampler.peaks.values())
    self_max = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    children_max = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024
    if sampler.at_peak:
        print(f"at the peak, {sampler.at_peak}")
    print(f"peak of the run: {peak / GIB:.2f} GiB (sampled tree); ru_maxrss: this process "
          f"{self_max / GIB:.2f} GiB, largest waited-for child {children_max / GIB:.2f} GiB")


if __name__ == "__main__":
    main()
