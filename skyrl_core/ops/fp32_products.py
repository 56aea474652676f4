"""bf16 matrix products computed as fp32 ones, for CPUs with no bf16 GEMM: the
``fp32_products.linear`` op implementation.

On a CPU without AVX-512 (AVX2 only: AMD EPYC before Zen 4, older Intel) oneDNN has no bf16 inner
product, and PyTorch's own bf16 GEMM runs at 2-20 GFLOP/s where fp32 runs at 110-180
(``benchmarks/cpu_gemm.py`` on a 2-core AMD EPYC, 2026-12-02). A bf16 product with fp32
accumulation is exactly an fp32 product of the same (exactly representable) values rounded once to
bf16, so this implementation widens the operands, multiplies in fp32 on PyTorch's BLAS and rounds the
result: the arithmetic of a bf16 GEMM in another summation order, 5-8x faster there. It saves the
bf16 operands for backward (no fp32 copies held between forward and backward) and returns bf16
gradients the same way. A stock-numerics choice, not a contract: IsoExec installs its canonical
linear in its place when enabled.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from skyrl_core.ops.shapes import reshape_fresh
from skyrl_core.plugins.records import OpImplSpec

FP32_PRODUCTS_LINEAR = OpImplSpec(
    name="fp32_products.linear",
    op="linear",
    factory="skyrl_core.ops.fp32_products:linear",
    version="1",
    description="bf16 CPU matrix products computed in fp32 and rounded (CPUs without a bf16 GEMM); F.linear elsewhere",
)


class _Fp32ProductsLinear(torch.autograd.Function):
    """``y = x W^T + b`` and both gradients as fp32 products of the bf16 operands, rounded to bf16."""

    @staticmethod
    def forward(ctx, x2, weight, bias):
        ctx.save_for_backward(x2, weight)
        ctx.has_bias = bias is not None
        return F.linear(x2.float(), weight.float(), None if bias is None else bias.float()).to(x2.dtype)

    @staticmethod
    def backward(ctx, grad):
        x2, weight = ctx.saved_tensors
        grad32 = grad.float()
        grad_x = grad32.mm(weight.float()).to(x2.dtype) if ctx.needs_input_grad[0] else None
        grad_w = grad32.t().mm(x2.float()).to(weight.dtype) if ctx.needs_input_grad[1] else None
        grad_b = grad32.sum(0).to(weight.dtype) if ctx.has_bias and ctx.needs_input_grad[2] else None
        return grad_x, grad_w, grad_b


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear`` for bf16 CPU tensors through fp32 products; ``F.linear`` for anything else."""
    if not (x.device.type == "cpu" and x.dtype == torch.bfloat16 and weight.dtype == torch.bfloat16):
        return F.linear(x, weight, bias)
    lead = x.shape[:-1]
    out = _Fp32ProductsLinear.apply(x.reshape(-1, x.shape[-1]), weight, bias)
    return reshape_fresh(out, (*lead, weight.shape[0]))  # not a view: see skyrl_core.ops.shapes
