"""fp32 matrix products on oneDNN for CPU runtimes: the ``onednn.linear`` op implementation.

``torch.nn.functional.linear`` on fp32 CPU tensors calls the BLAS PyTorch was built with (MKL in
the PyPI wheels). On some CPUs MKL takes a slow path: on this project's AMD EPYC machine oneDNN's
fp32 GEMM runs 1.5-2.1x faster on the shapes of a 135M model's forward and backward
(``benchmarks/cpu_gemm.py``). oneDNN computes the same fp32 products in another summation order,
with fp32 accumulation; its largest error against an fp64 product measured 2-3x MKL's (1.2e-4 vs
5e-5 on K = 576 random normals, relative to outputs of about 24), and a 30-layer SmolLM2's token
logprobs move by up to about 2e-5. That is noise for RL; it is a stock-numerics choice, not a
contract: IsoExec replaces it with its canonical linear when enabled, and
``backend.options.cpu_gemm: torch`` keeps MKL. The default, ``auto``, takes whichever of the two is
faster on the machine, measured there (``skyrl_core.ops.gemm_choice``): on a later AMD EPYC (family
25, AVX2 only) MKL was the faster, 1.41x.

Other devices and dtypes (CUDA, bf16, which PyTorch already sends to oneDNN on CPU) take
``torch.nn.functional.linear`` unchanged.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from skyrl_core.ops.shapes import reshape_fresh
from skyrl_core.plugins.records import OpImplSpec

ONEDNN_LINEAR = OpImplSpec(
    name="onednn.linear",
    op="linear",
    factory="skyrl_core.ops.onednn:linear",
    version="1",
    description="fp32 CPU matrix products (forward and backward) on oneDNN; F.linear elsewhere",
)
@functools.cache
def available() -> bool:
    """Whether this PyTorch has oneDNN's linear kernel (the PyPI CPU and CUDA wheels do)."""
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


def mm_nt(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ weight.T (+ bias)`` on oneDNN, no autograd; ``x`` ``[..., K]``, ``weight`` ``[N, K]``."""
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")


def mm_nt_add(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, addend: torch.Tensor) -> torch.Tensor:
    """``x @ weight.T (+ bias) + addend`` in one oneDNN call (a residual connection), no autograd."""
    return torch.ops.mkldnn._linear_pointwise.binary(x, addend, weight, bias, "add")


# Rows oneDNN is told to expect when it reorders a weight; its fp32 blocked layout is the same for
# any count >= 8 (vLLM-CPU packs with the same hint).
PACK_ROWS_HINT = 64
_PROBE_ROWS = 16


def prepack(weight: torch.Tensor, *, bf16: bool = False) -> torch.Tensor | None:
    """``weight`` ``[N, K]`` reordered once into the blocked layout oneDNN's GEMM computes from, or
    None for anything but a CPU fp32 weight (also bf16 with ``bf16=True`` on a CPU where oneDNN
    computes bf16, ``bf16_supported``) with oneDNN available.

    ``mm_nt`` and ``mm_nt_add`` take the result in place of the plain weight: the same kernel
    without the copy into that layout it otherwise makes on every call (12-25% of a decode-sized
    fp32 GEMM here; 1.0-2.4x faster per bf16 decode GEMM at batch 64), hence the same bits (bf16:
    checked bit for bit, ``tests/core/test_onednn_linear.py``). It is a copy: it goes stale
    when the weight changes. bf16 is opt-in: only ``mm_nt`` reads it, while a linear that computes
    bf16 with ``torch.mm`` (IsoExec's canonical one) would read a packed weight as a plain one.
    """
    if weight.device.type != "cpu" or weight.dtype not in ((torch.float32, torch.bfloat16) if bf16 else (torch.float32,)):
        return None
    if not computes(weight.dtype):
        return None
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(), PACK_ROWS_HINT)


@functools.cache
def bf16_supported() -> bool:
    """Whether oneDNN computes bf16 products on this CPU: AVX-512 (BW/VL/DQ) or newer, natively
    with AVX512-BF16 or AMX, by converting to fp32 inside the kernel on plain AVX-512."""
    return available() and bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


def computes(dtype: torch.dtype) -> bool:
    """Whether ``mm_nt`` runs products in ``dtype`` on this CPU: fp32 wherever oneDNN is available,
    bf16 only where ``bf16_supported`` (on an AVX2-only CPU oneDNN has no bf16 inner product: it
    fails to create the primitive, so such a runtime must take torch's products)."""
    if dtype == torch.float32:
        return available()
    return dtype == torch.bfloat16 and bf16_supported()


def prepack_if_same_bits(weight: torch.Tensor, linear_fn) -> torch.Tensor | None:
    """``prepack(weight)`` when ``linear_fn(x, packed)`` gives ``linear_fn(x, weight)``'s bits on a
    probe (for a linear whose bits are a contract), else None, also where ``linear_fn`` cannot
    take a packed weight at all."""
    packed = prepack(weight)
    if packed is None:
        return None
    probe = torch.randn(_PROBE_ROWS, weight.shape[1], generator=torch.Generator().manual_seed(0))
    try:
        same = torch.equal(linear_fn(probe, packed).view(torch.int32), linear_fn(probe, weight).view(torch.int32))
    except (RuntimeError, TypeError, ValueError):
        return None
    return packed if same else None


def _wants_onednn(x: torch.Tensor, weight: torch.Tensor) -> bool:
    return x.device.type == "cpu" and x.dtype == torch.float32 and weight.dtype == torch.float32 and available()


class _OneDNNLinear(torch.autograd.Function):
    """All three products of a linear layer on oneDNN: ``y = x W^T``, ``dx = dy W``, ``dW = dy^T x``."""

    @staticmethod
    def forward(ctx, x2, weight, bias):
        ctx.save_for_backward(x2, weight)
        ctx.has_bias = bias is not None
        return mm_nt(x2, weight, bias)

    @staticmethod
    def backward(ctx, grad):
        x2, weight = ctx.saved_tensors
        return linear_grads(grad, x2, weight, ctx.needs_input_grad, ctx.has_bias)


def linear_grads(
    grad: torch.Tensor, x2: torch.Tensor, weight: torch.Tensor, needs: tuple[bool, ...], has_bias: bool
) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """``(dx, dW, db)`` of ``y = x2 W^T + b`` for ``grad = dy`` ``[M, N]``, computing only those
    ``needs`` asks for: oneDNN products for fp32 CPU tensors, ``torch.mm`` otherwise. Also the
    backward of IsoExec's canonical linear (only its forward is canonical)."""
    if _wants_onednn(grad, weight):
        grad = grad.contiguous()
        # Transposed views, not copies: oneDNN reads strided operands itself (same bits, measured
        # faster than copying the lm_head weight per micro-batch).
        grad_x = mm_nt(grad, weight.t()) if needs[0] else None
        grad_w = mm_nt(grad.t(), x2.t()) if needs[1] else None
    else:
        grad_x = grad.mm(weight) if needs[0] else None
        grad_w = grad.t().mm(x2) if needs[1] else None
    grad_b = grad.sum(0) if has_bias and needs[2] else None
    return grad_x, grad_w, grad_b


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear`` with fp32 CPU products on oneDNN; differentiable in all arguments."""
    if not _wants_onednn(x, weight):
        return F.linear(x, weight, bias)
    lead = x.shape[:-1]
    out = _OneDNNLinear.apply(x.reshape(-1, x.shape[-1]).contiguous(), weight, bias)
    return reshape_fresh(out, (*lead, weight.shape[0]))  # not a view: see skyrl_core.ops.shapes
