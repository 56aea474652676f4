"""A CPU runtime's linear layers: which implementation multiplies them (``linear_defaults``), and
for ``cpu_gemm: auto`` the library that multiplies fp32 training products fastest on this machine,
measured there, not assumed.

Neither library wins everywhere. On one 2-core AMD EPYC oneDNN's fp32 GEMM ran 1.5-2.1x MKL's at a
135M model's training shapes; on another (family 25, AVX2 only, 2026-12-02) MKL ran 1.41x oneDNN's
(``benchmarks/cpu_gemm.py``). So ``auto`` times both on the products a training step is made of
(forward, input gradient and weight gradient at a SmolLM2 micro-batch's shapes), alternating, and
takes the faster; oneDNN keeps a tie (within ``TIE``).

The answer is kept per machine (CPU model, PyTorch version, thread count) in
``$SKYRL_CACHE_DIR/cpu_gemm.json`` (default ``~/.cache/skyrl``), written under a file lock: every
process of a run (each FSDP rank, the Tinker server) and every later run on the machine takes the same
library, so a run's numerics do not depend on a timing taken under load at its start. Delete the file
to measure again. Where the cache cannot be written the answer is kept for the process only.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import json
import os
import platform
import time
from pathlib import Path
from typing import Iterator

import torch
import torch.nn.functional as F

from skyrl_core.ops import onednn
from skyrl_core.ops.fp32_products import FP32_PRODUCTS_LINEAR
from skyrl_core.plugins.records import OpImplSpec

# rows x in x out of the products measured: a micro-batch of 512 tokens through SmolLM2's MLP
SHAPES = ((512, 576, 1536), (512, 1536, 576))
ROUNDS = 3
TIE = 0.05  # torch must be this much faster to be taken over oneDNN
CACHE_FILE = "cpu_gemm.json"

# A CPU runtime's choice for its fp32 products: oneDNN, PyTorch's BLAS (``F.linear``), or the faster
# of the two on this machine, measured once (``faster_fp32_gemm``).
CPU_GEMMS = ("auto", "onednn", "torch")


def linear_defaults(cpu_gemm: str, dtype: torch.dtype, device: str = "cpu") -> dict[str, OpImplSpec]:
    """``prepare_model``'s ``defaults`` for a runtime computing in ``dtype`` on ``device``:
    ``{"linear": ONEDNN_LINEAR}`` for fp32 on CPU with ``cpu_gemm="onednn"`` (or ``"auto"`` where
    oneDNN measured faster) and oneDNN available; for bf16 on a CPU where oneDNN has no bf16
    products (``onednn.computes``), the fp32-products linear (``skyrl_core.ops.fp32_products``:
    PyTorch's own bf16 GEMM is 5-50x slower there); else none (the stock ``F.linear``)."""
    if cpu_gemm not in CPU_GEMMS:
        raise ValueError(f"cpu_gemm {cpu_gemm!r}: allowed: {', '.join(CPU_GEMMS)}")
    if device != "cpu":
        return {}
    if dtype == torch.float32 and onednn.available():
        if cpu_gemm == "auto":
            cpu_gemm = faster_fp32_gemm()
        return {"linear": onednn.ONEDNN_LINEAR} if cpu_gemm == "onednn" else {}
    if dtype == torch.bfloat16 and not onednn.computes(torch.bfloat16):
        return {"linear": FP32_PRODUCTS_LINEAR}
    return {}


def cache_dir() -> Path:
    return Path(os.environ.get("SKYRL_CACHE_DIR") or Path.home() / ".cache" / "skyrl")


def machine_key() -> str:
    """What the answer depends on: the CPU model, PyTorch's version and the thread count."""
    model = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    model = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return f"{model} | torch {torch.__version__} | {torch.get_num_threads()} threads"


def measure() -> dict[str, float]:
    """GFLOP/s of each library on ``SHAPES`` (forward and both backward products), best of
    ``ROUNDS`` alternating rounds."""
    gen = torch.Generator().manual_seed(0)
    work = [(torch.randn(m, k, generator=gen), torch.randn(n, k, generator=gen), torch.randn(m, n, generator=gen)) for m, k, n in SHAPES]
    flops = sum(3 * 2 * m * k * n for m, k, n in SHAPES)

    def run_torch() -> None:
        for x, w, g in work:
            F.linear(x, w), g.mm(w), g.t().mm(x)

    def run_onednn() -> None:
        for x, w, g in work:
            onednn.mm_nt(x, w), onednn.linear_grads(g, x, w, (True, True, False), False)

    runs = {"onednn": run_onednn, "torch": run_torch}
    best = {name: float("inf") for name in runs}
    for run in runs.values():
        run()  # warm-up: first-call setup is not the library's speed
    for _ in range(ROUNDS):
        for name, run in runs.items():
            start = time.perf_counter()
            run()
            best[name] = min(best[name], time.perf_counter() - start)
    return {name: flops / seconds / 1e9 for name, seconds in best.items()}


def choose(rates: dict[str, float]) -> str:
    return "torch" if rates["torch"] > rates["onednn"] * (1 + TIE) else "onednn"


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.with_suffix(".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


@functools.cache
def faster_fp32_gemm() -> str:
    """``"onednn"`` or ``"torch"``: this machine's answer, from the cache file or measured now (and
    written there). Without oneDNN, ``"torch"``."""
    if not onednn.available():
        return "torch"
    key, path = machine_key(), cache_dir() / CACHE_FILE
    try:
        with _locked(path):
            known = json.loads(path.read_text()) if path.exists() else {}
            if key not in known:
                rates = measure()
                known[key] = {"choice": choose(rates), "gflops": {k: round(v, 1) for k, v in rates.items()}}
                tmp = path.with_suffix(".tmp")
                tmp.write_text(json.dumps(known, indent=1, sort_keys=True))
                os.replace(tmp, path)
            return known[key]["choice"]
    except (OSError, ValueError, KeyError):  # no writable cache, or a damaged one: measure for this process
        return choose(measure())
