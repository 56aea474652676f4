"""Row-invariant GEMM: rows are zero-padded to a multiple of ``LINEAR_ROW_ALIGN`` (8) and computed
in one GEMM: on CPU in fp32 oneDNN's (``skyrl_core.ops.onednn.mm_nt``), otherwise ``torch.mm``
(oneDNN for CPU bf16, cuBLAS on CUDA).

Measured on this project's CPU (AVX-512, ``test_kernels.py`` keeps checking it): a row of
``F.linear`` (MKL, fp32) depends on how many rows are computed with it (M = 1..3 take other
kernels; with 2 threads the tail rows of M = 5, 6, 7, 9 do), but when M is a multiple of 8 every
row gets the bits it gets in an 8-row GEMM, at any position, for any such M, with 1 or 2 threads,
provided the weight has at least ``LINEAR_MIN_COLUMNS`` rows (a single output column takes a
GEMV-like path; narrower weights are zero-padded). oneDNN's fp32 GEMM has the same property and
runs 1.5-2.1x faster than MKL here (``benchmarks/cpu_gemm.py``), so it is the fp32 kernel (version 3
of the spec; version 2 was MKL). Padding to a multiple of 8 makes a token's projection independent
of the batch, at the cost of at most 7 padding rows. Columns are independent too: an output column
gets the bits of its own weight row alone, whatever rows are stacked with it, so an engine may run
q/k/v (or gate/up) as one GEMM over the concatenated weight where the trainer runs three
(``test_linear_columns_are_independent_of_the_other_columns``). Gradients are the ordinary ones
(``grad @ W``, ``grad.T @ x``, on oneDNN in fp32 too): only the forward must be canonical.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from skyrl_core.ops import onednn
from skyrl_core.ops.shapes import reshape_fresh

from skyrl_isoexec.constants import LINEAR_DTYPES, LINEAR_MIN_COLUMNS, LINEAR_ROW_ALIGN

SUPPORTED_DTYPES = tuple(getattr(torch, name) for name in LINEAR_DTYPES)


def aligned_rows(rows: int) -> int:
    """The row count a canonical GEMM computes for ``rows`` rows: a multiple of 8, at least 8."""
    return max(LINEAR_ROW_ALIGN, -(-rows // LINEAR_ROW_ALIGN) * LINEAR_ROW_ALIGN)


def row_aligned_matmul(x2: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``x2 @ weight.T`` for ``x2`` ``[M, K]``, ``weight`` ``[N, K]``, rows padded to a multiple of 8."""
    if x2.dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"canonical linear supports {', '.join(LINEAR_DTYPES)}, got {x2.dtype}")
    rows, columns = x2.shape[0], weight.shape[0]
    if columns < LINEAR_MIN_COLUMNS:
        weight = F.pad(weight, (0, 0, 0, LINEAR_MIN_COLUMNS - columns))
    padded_rows = aligned_rows(rows)
    if padded_rows != rows:
        x2 = F.pad(x2, (0, 0, 0, padded_rows - rows))
    out = _gemm(x2, weight)
    if padded_rows != rows or columns != out.shape[1]:
        out = out[:rows, :columns]
    return out


def _cpu_fp32(x: torch.Tensor) -> bool:
    return x.device.type == "cpu" and x.dtype == torch.float32


def _gemm(x2: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``x2 @ weight.T``: oneDNN for CPU fp32, else ``torch.mm`` (see the module docstring)."""
    if _cpu_fp32(x2):
        if not onednn.available():
            raise RuntimeError("canonical linear (fp32, CPU) needs a PyTorch built with oneDNN (torch.ops.mkldnn)")
        return onednn.mm_nt(x2, weight)
    return torch.mm(x2, weight.t())


class _RowAlignedLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x2, weight, bias):
        ctx.save_for_backward(x2, weight)
        ctx.has_bias = bias is not None
        out = row_aligned_matmul(x2, weight)
        return out + bias if bias is not None else out

    @staticmethod
    def backward(ctx, grad):
        x2, weight = ctx.saved_tensors
        return onednn.linear_grads(grad, x2, weight, ctx.needs_input_grad, ctx.has_bias)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear`` with every output row independent of the other rows; differentiable."""
    if weight.dtype != x.dtype:
        raise TypeError(f"canonical linear: input is {x.dtype} but weight is {weight.dtype}")
    x2 = x.reshape(-1, x.shape[-1])
    if torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad or (bias is not None and bias.requires_grad)):
        out = _RowAlignedLinear.apply(x2, weight, bias)
    else:
        out = row_aligned_matmul(x2, weight)
        if bias is not None:
            out = out + bias
    return reshape_fresh(out, (*x.shape[:-1], weight.shape[0]))  # not a view: see skyrl_core.ops.shapes


# Engines may fuse projections over this linear (see the module docstring; skyrl-torch reads it).
linear.columns_independent = True
# In fp32 on CPU it takes weights prepacked by ``onednn.prepack`` (its GEMM is ``onednn.mm_nt``);
# elsewhere ``prepack`` gives none. Engines still probe each packed weight for the same bits.
linear.onednn_packed_weights = True
