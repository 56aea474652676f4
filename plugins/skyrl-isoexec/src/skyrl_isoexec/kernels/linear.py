"""Row-invariant GEMM: rows are computed in fixed-shape blocks of ``ROW_BLOCK[dtype]`` (zero-padded).

Measured on MKL/oneDNN (DESIGN.md section 6): a row of ``F.linear`` depends on how many rows are
computed with it (M = 1..3 take other kernels; with 2 threads the tail rows of M = 5, 6, 7, 9 do),
but within one fixed block shape the result of a row depends only on that row, at any position in
the block and with 1 or 2 threads, provided the weight has at least ``LINEAR_MIN_COLUMNS`` rows
(a single output column takes a GEMV-like path whose rows depend on the block count; narrower
weights are zero-padded). fp32 runs every block in one ``bmm`` against a stride-0 weight;
a single block runs ``torch.mm``, whose bits equal a ``bmm`` item's (asserted by the tests);
bf16 runs ``F.linear`` per block (oneDNN's bf16 ``bmm`` is an order of magnitude slower).
Gradients are the ordinary ones (``grad @ W``, ``grad.T @ x``): only the forward must be canonical.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from skyrl_isoexec.constants import LINEAR_MIN_COLUMNS, LINEAR_ROW_BLOCK

ROW_BLOCK = {dtype: LINEAR_ROW_BLOCK[str(dtype).removeprefix("torch.")] for dtype in (torch.float32, torch.bfloat16)}


def _padded_rows(x2: torch.Tensor, block: int) -> tuple[torch.Tensor, int]:
    rows = x2.shape[0]
    blocks = max(1, -(-rows // block))
    if blocks * block != rows:
        x2 = F.pad(x2, (0, 0, 0, blocks * block - rows))
    return x2, blocks


def row_block_matmul(x2: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``x2 @ weight.T`` for ``x2`` ``[M, K]``, ``weight`` ``[N, K]``, computed in fixed row blocks."""
    block = ROW_BLOCK.get(x2.dtype)
    if block is None:
        raise TypeError(f"canonical linear supports {sorted(map(str, ROW_BLOCK))}, got {x2.dtype}")
    rows, columns = x2.shape[0], weight.shape[0]
    if columns < LINEAR_MIN_COLUMNS:  # a 1-column GEMM takes another kernel whose rows depend on M
        weight = F.pad(weight, (0, 0, 0, LINEAR_MIN_COLUMNS - columns))
    padded, blocks = _padded_rows(x2.contiguous(), block)
    if x2.dtype == torch.float32 and blocks == 1:
        out = torch.mm(padded, weight.t())  # the same bits as one bmm item (tested), without its threading cost
    elif x2.dtype == torch.float32:
        out = torch.bmm(padded.view(blocks, block, -1), weight.t().unsqueeze(0).expand(blocks, -1, -1))
        out = out.view(blocks * block, -1)
    else:
        out = torch.cat([F.linear(padded[i * block : (i + 1) * block], weight) for i in range(blocks)])
    return out[:rows, :columns]


class _RowBlockLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x2, weight, bias):
        ctx.save_for_backward(x2, weight)
        ctx.has_bias = bias is not None
        out = row_block_matmul(x2, weight)
        return out + bias if bias is not None else out

    @staticmethod
    def backward(ctx, grad):
        x2, weight = ctx.saved_tensors
        grad_x = grad.mm(weight) if ctx.needs_input_grad[0] else None
        grad_w = grad.t().mm(x2) if ctx.needs_input_grad[1] else None
        grad_b = grad.sum(0) if ctx.has_bias and ctx.needs_input_grad[2] else None
        return grad_x, grad_w, grad_b


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear`` with every output row independent of the other rows; differentiable."""
    if weight.dtype != x.dtype:
        raise TypeError(f"canonical linear: input is {x.dtype} but weight is {weight.dtype}")
    x2 = x.reshape(-1, x.shape[-1])
    if torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad or (bias is not None and bias.requires_grad)):
        out = _RowBlockLinear.apply(x2, weight, bias)
    else:
        out = row_block_matmul(x2, weight)
        if bias is not None:
            out = out + bias
    return out.view(*x.shape[:-1], weight.shape[0])
