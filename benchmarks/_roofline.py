"""This machine's own limit for a benchmark's work, measured in the same run (not a benchmark:
``make bench`` skips ``_*.py``).

A benchmark describes its work as the matrix products of its linear layers (``Gemm``: ``[m, k] x
[k, n]``, ``count`` times; ``decoder_gemms`` writes them down for a transformers decoder config).
``Roofline.measure`` times each distinct shape, a few seconds in all, with every library a
framework here may use:

- fp32 ``mkl``: ``torch.mm`` (PyTorch's BLAS: MKL in the PyPI wheels; what stock PyTorch, HF and TRL use);
- fp32 ``onednn``: ``skyrl_core.ops.onednn.mm_nt`` (oneDNN's inner product; skyrl's default);
- bf16 ``torch``: ``torch.mm`` on bf16 (ATen hands it to oneDNN's matmul on CPUs with AVX512);
- bf16 ``onednn``: ``mm_nt`` on bf16 (oneDNN's inner product).

The floor of the work in a dtype is the sum over its products of FLOPs / the fastest measured rate
at that shape; a measured time divided into the floor is the fraction of the measured peak
achieved. Only the linear layers' products count (attention scores, norms, sampling and the
optimizer are not GEMM FLOPs here), so the floor is a lower bound no implementation can beat at
these rates. Large dimensions are capped for timing (rows and reduction at 1024, columns at 8192:
the rate no longer grows there) so that the measurement stays short.
"""

from __future__ import annotations

import os
import platform
import subprocess
import time
from dataclasses import dataclass
from typing import Any, Iterable

LIBRARIES = {"float32": ("mkl", "onednn"), "bfloat16": ("torch", "onednn")}
_CAP_ROWS, _CAP_INNER, _CAP_COLS = 1024, 1024, 8192
# Per timed repeat: short, so that best-of-N finds a quiet moment on a shared machine, and at most
# _MAX_CALLS calls so that tiny shapes do not spend the budget on call overhead.
_TIMED_FLOPS, _MAX_CALLS = 0.05e9, 16


@dataclass(frozen=True)
class Gemm:
    """``count`` products ``[rows, inner] x [inner, cols]``."""

    rows: int
    inner: int
    cols: int
    count: int = 1

    @property
    def flops(self) -> int:
        return 2 * self.rows * self.inner * self.cols * self.count

    @property
    def shape(self) -> tuple[int, int, int]:
        return (self.rows, self.inner, self.cols)


def linear_gemms(rows: int, inner: int, out: int, *, count: int = 1, backward: bool = False) -> list[Gemm]:
    """The products of ``count`` linear layers ``inner -> out`` on ``rows`` rows: the forward, and with
    ``backward`` the input gradient ``[rows, out] x [out, inner]`` and the weight gradient
    ``[out, rows] x [rows, inner]``."""
    if rows <= 0:
        return []
    gemms = [Gemm(rows, inner, out, count)]
    if backward:
        gemms += [Gemm(rows, out, inner, count), Gemm(out, rows, inner, count)]
    return gemms


def decoder_gemms(config: Any, rows: int, lm_head_rows: int, *, backward: bool = False) -> list[Gemm]:
    """The linear layers' products of a decoder (a transformers config or its dict) over ``rows``
    token positions, with the unembedding on ``lm_head_rows`` of them. Dense MLPs only (an MoE
    config is counted as if its ``intermediate_size`` MLP were dense)."""
    get = config.get if isinstance(config, dict) else lambda key, default=None: getattr(config, key, default)
    hidden, layers = get("hidden_size"), get("num_hidden_layers")
    heads = get("num_attention_heads")
    head_dim = get("head_dim") or hidden // heads
    kv_heads = get("num_key_value_heads") or heads
    ffn, vocab = get("intermediate_size"), get("vocab_size")
    # q/k/v as one product and gate/up as one: the same FLOPs at wider shapes, which run faster, so
    # the floor does not charge a framework for products it could fuse.
    gemms = []
    gemms += linear_gemms(rows, hidden, (heads + 2 * kv_heads) * head_dim, count=layers, backward=backward)  # qkv
    gemms += linear_gemms(rows, heads * head_dim, hidden, count=layers, backward=backward)  # o
    gemms += linear_gemms(rows, hidden, 2 * ffn, count=layers, backward=backward)  # gate/up
    gemms += linear_gemms(rows, ffn, hidden, count=layers, backward=backward)  # down
    gemms += linear_gemms(lm_head_rows, hidden, vocab, backward=backward)
    return gemms


def generation_gemms(config: Any, prompt_tokens: int, generated_tokens: int, sequences: int, steps: int) -> list[Gemm]:
    """Sampling: the prefill of ``prompt_tokens`` positions (logits of each sequence's last one), then
    ``generated_tokens`` decoded in ``steps`` batched steps (rows = the average batch of a step)."""
    gemms = decoder_gemms(config, prompt_tokens, sequences)
    if generated_tokens and steps:
        batch = max(1, round(generated_tokens / steps))
        gemms += [Gemm(g.rows, g.inner, g.cols, g.count * steps) for g in decoder_gemms(config, batch, batch)]
    return gemms


def model_config_dict(model: Any) -> dict[str, Any]:
    """The transformers config of a ``ModelConfig`` as a dict (its ``config``, or ``path``'s config.json)."""
    import json

    if model.config is not None:
        return dict(model.config)
    with open(os.path.join(os.path.expanduser(model.path), "config.json")) as f:
        return json.load(f)


def rollout_roofline(config: Any, prompt_lengths: Iterable[int], generated_tokens: int, max_new_tokens: int,
                     *, threads: int) -> "Roofline":
    """The measured roofline of sampling ``generated_tokens`` after ``prompt_lengths`` (one sequence
    each; decode steps: ``max_new_tokens``)."""
    prompts = list(prompt_lengths)
    gemms = generation_gemms(config, sum(prompts), generated_tokens, len(prompts), max_new_tokens)
    return Roofline(gemms, threads=threads).measure()


def total_flops(gemms: Iterable[Gemm]) -> int:
    return sum(g.flops for g in gemms)


def _timing_shape(shape: tuple[int, int, int]) -> tuple[int, int, int]:
    m, k, n = shape
    return (min(m, _CAP_ROWS), min(k, _CAP_INNER), min(n, _CAP_COLS))


def _product(dtype: str, library: str, m: int, k: int, n: int):
    import torch

    from skyrl_core.ops.onednn import mm_nt

    torch_dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[dtype]
    gen = torch.Generator().manual_seed(0)
    a = torch.randn(m, k, generator=gen).to(torch_dtype)
    if library == "onednn":
        w = torch.randn(n, k, generator=gen).to(torch_dtype)  # mm_nt computes a @ w.T
        return lambda: mm_nt(a, w)
    b = torch.randn(k, n, generator=gen).to(torch_dtype)
    return lambda: torch.mm(a, b)


def _rate(fn, flops: int, repeats: int) -> float:
    """Best GFLOP/s of ``repeats`` short timed runs (after a warm-up): the machine's limit, not its
    mood. On a machine shared with other work the best of several short runs is the one the others
    left alone; the load average is printed beside (``machine``), as the rates still fall with it."""
    calls = min(_MAX_CALLS, max(1, round(_TIMED_FLOPS / flops)))
    fn()
    best = float("inf")
    for _ in range(repeats):
        started = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, (time.perf_counter() - started) / calls)
    return flops / best / 1e9


class Roofline:
    """Measured GEMM rates at a work's shapes, and that work's floor and achieved fraction."""

    def __init__(self, gemms: Iterable[Gemm], *, threads: int, dtypes: Iterable[str] = ("float32", "bfloat16")) -> None:
        self.gemms = list(gemms)
        self.threads = threads
        self.dtypes = tuple(dtypes)
        self.rates: dict[tuple[str, str, tuple[int, int, int]], float] = {}
        self.seconds_measuring = 0.0

    def measure(self, repeats: int = 5) -> "Roofline":
        """Time every distinct (timing) shape with every library; again later keeps the best rates
        (a busy machine only ever lowers them)."""
        import torch

        from skyrl_core.ops.onednn import computes as onednn_computes

        previous = torch.get_num_threads()
        torch.set_num_threads(self.threads)
        started = time.perf_counter()
        try:
            with torch.no_grad():
                for shape in sorted({_timing_shape(g.shape) for g in self.gemms}):
                    flops = 2 * shape[0] * shape[1] * shape[2]
                    for dtype in self.dtypes:
                        for library in LIBRARIES[dtype]:
                            # 0: oneDNN has no bf16 products on this CPU (AVX2 only: no primitive)
                            runs = library != "onednn" or onednn_computes(getattr(torch, dtype))
                            rate = _rate(_product(dtype, library, *shape), flops, repeats) if runs else 0.0
                            key = (dtype, library, shape)
                            self.rates[key] = max(rate, self.rates.get(key, 0.0))
        finally:
            torch.set_num_threads(previous)
        self.seconds_measuring += time.perf_counter() - started
        return self

    def part(self, gemms: Iterable[Gemm]) -> "Roofline":
        """The roofline of part of this work (its shapes already measured): same rates, own floor."""
        part = Roofline(gemms, threads=self.threads, dtypes=self.dtypes)
        part.rates, part.seconds_measuring = self.rates, self.seconds_measuring
        return part

    @property
    def flops(self) -> int:
        return total_flops(self.gemms)

    def _rate_at(self, dtype: str, library: str | None, gemm: Gemm) -> float:
        shape = _timing_shape(gemm.shape)
        libraries = LIBRARIES[dtype] if library is None else (library,)
        return max(self.rates[(dtype, lib, shape)] for lib in libraries)

    def floor(self, dtype: str, library: str | None = None) -> float:
        """Seconds the work's products take at the measured rates (``library`` None: the fastest
        library at each shape)."""
        rates = [self._rate_at(dtype, library, g) for g in self.gemms]
        if not all(rates):  # a library that cannot run this dtype here
            return float("inf")
        return sum(g.flops / (rate * 1e9) for g, rate in zip(self.gemms, rates))

    def peak(self, dtype: str, library: str | None = None) -> float:
        """GFLOP/s of the whole work at its floor."""
        return self.flops / self.floor(dtype, library) / 1e9

    def summary(self) -> str:
        """Work, per-library rates and floors, on a few lines."""
        lines = [f"roofline: {self.flops / 1e12:.3f} TFLOP of linear-layer GEMMs in {len(self.gemms)} shapes' products, "
                 f"{self.threads} threads, measured in {self.seconds_measuring:.1f} s"]
        for dtype in self.dtypes:
            parts = [f"{lib} {self.peak(dtype, lib):.0f} GFLOP/s" for lib in LIBRARIES[dtype]]
            lines.append(f"  {dtype:8s} at this work's shapes: {', '.join(parts)}; floor (fastest per shape) "
                         f"{self.floor(dtype):.2f} s = {self.peak(dtype):.0f} GFLOP/s")
        return "\n".join(lines)

    def achieved(self, label: str, seconds: float, dtype: str, *, flops: int | None = None) -> str:
        """``label``'s time beside the ``dtype`` floor: achieved GFLOP/s, fraction of the measured
        peak, and the time as a multiple of the floor. ``flops`` when the side did other work."""
        work = self.flops if flops is None else flops
        floor = self.floor(dtype) * work / self.flops
        return (f"{label}: {seconds:.2f} s, {work / seconds / 1e9:.0f} GFLOP/s = {floor / seconds:.0%} of the "
                f"measured {dtype} peak ({seconds / floor:.2f}x its floor {floor:.2f} s)")


def _cpuinfo() -> dict[str, str]:
    fields: dict[str, str] = {}
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                key = key.strip()
                if key and key not in fields:
                    fields[key] = value.strip()
                if not line.strip() and fields:
                    break  # the first processor's block
    except OSError:
        pass
    return fields


def machine() -> str:
    """CPU model and family, the bf16/AMX flags, cores, load, and the GEMM libraries of this torch."""
    import torch

    info = _cpuinfo()
    flags = set(info.get("flags", "").split())
    wanted = [f for f in ("avx512f", "avx512_bf16", "amx_bf16", "amx_tile", "avx512_fp16") if f in flags]
    model = info.get("model name", platform.processor() or platform.machine())
    family = f"family {info.get('cpu family', '?')} model {info.get('model', '?')}"
    config = torch.__config__.show()
    mkl = next((line.split("Version")[1].split("-")[0].strip() for line in config.splitlines() if "Math Kernel" in line), None)
    onednn = next((line.split("v", 1)[1].split()[0] for line in config.splitlines() if "MKL-DNN" in line or "oneDNN" in line), None)
    load = " ".join(f"{x:.2f}" for x in os.getloadavg())
    return (f"CPU: {model} ({family}), {os.cpu_count()} cores, flags {' '.join(wanted) or 'no avx512/amx'}; load average "
            f"{load}\nGEMM libraries: torch {torch.__version__}, MKL {mkl or 'absent'} (fp32 torch.mm: "
            f"{'MKL' if torch.backends.mkl.is_available() else 'another BLAS'}), oneDNN {onednn or 'absent'} "
            f"(mkldnn available: {torch.backends.mkldnn.is_available()}; bf16 torch.mm and skyrl_core.ops.onednn)")


def uptime() -> str:
    try:
        return subprocess.run(["uptime"], capture_output=True, text=True, check=False).stdout.strip()
    except OSError:
        return "load average " + " ".join(f"{x:.2f}" for x in os.getloadavg())


def gemm_rate_table(roofline: Roofline) -> str:
    """Per shape: GFLOP/s of every library (what ``cpu_gemm.py`` prints to choose the bf16 path)."""
    lines = [f"{'m x k x n (timed)':>20} " + " ".join(f"{d[:4]}/{lib:>6}" for d in roofline.dtypes for lib in LIBRARIES[d])]
    for shape in sorted({_timing_shape(g.shape) for g in roofline.gemms}):
        rates = [roofline.rates[(d, lib, shape)] for d in roofline.dtypes for lib in LIBRARIES[d]]
        lines.append(f"{' x '.join(map(str, shape)):>20} " + " ".join(f"{r:11.0f}" for r in rates))
    return "\n".join(lines)
