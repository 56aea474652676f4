"""Canonical embedding, RMSNorm, rotary cos/sin and SiLU-gating."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from skyrl_isoexec.kernels.linear import aligned_rows
from skyrl_isoexec.kernels.reduce import silu

ROPE_TABLE_BLOCK = 256  # positions per cos/sin table block: one shape for every block


def embedding(ids: torch.Tensor, weight: torch.Tensor, padding_idx: int | None = None) -> torch.Tensor:
    """A gather: exact whatever the batch."""
    return F.embedding(ids, weight, padding_idx)


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, unit_offset: bool = False, gate: torch.Tensor | None = None
) -> torch.Tensor:
    """RMSNorm over the last dim; the fp32 sum of squares is a row-aligned GEMM against ones.

    Rounding points follow transformers: plain norms scale the normalised value *after* casting to
    the input dtype (``weight * y.to(dtype)``); ``unit_offset`` norms (Qwen3-Next) scale by
    ``1 + weight`` in fp32, then cast; a ``gate`` multiplies by ``silu(gate.float())`` in fp32, then casts.
    Without autograd (an engine, a scoring pass) the same operations run in place on their fresh
    intermediates (``_rms_norm_inference``): the same bits with three fewer full-size buffers.
    """
    if gate is None and not _needs_grad(x, weight):
        return _rms_norm_inference(x, weight, eps, unit_offset)
    dtype = x.dtype
    xf = x.float()
    variance = sum_of_squares(xf) / x.shape[-1]
    y = xf * torch.rsqrt(variance + eps).unsqueeze(-1)
    if unit_offset:
        out = y * (1.0 + weight.float())
        return out.to(dtype) if gate is None else (out.to(dtype).float() * silu(gate.float())).to(dtype)
    out = weight * y.to(dtype)
    return out if gate is None else (out * silu(gate.float())).to(dtype)


def _needs_grad(*tensors: torch.Tensor) -> bool:
    return torch.is_grad_enabled() and any(t.requires_grad for t in tensors)


def _rms_norm_inference(x: torch.Tensor, weight: torch.Tensor, eps: float, unit_offset: bool) -> torch.Tensor:
    """``rms_norm`` without a gate or autograd: each step is the same elementwise operation on the
    same operands (a product's operands swapped: IEEE products commute), written into an
    intermediate nothing else holds; ``x`` itself (``xf`` when fp32) is never written."""
    dtype = x.dtype
    xf = x.float()
    scale = _sum_of_squares_inference(xf).div_(x.shape[-1]).add_(eps).rsqrt_()
    y = xf * scale.unsqueeze(-1)
    if unit_offset:
        return y.mul_(1.0 + weight.float()).to(dtype)
    out = y.to(dtype)  # y itself in fp32: fresh either way
    return out.mul_(weight) if weight.dtype == dtype else weight * out  # another dtype promotes


_ones: dict[tuple, torch.Tensor] = {}


def _ones_for(xf: torch.Tensor) -> torch.Tensor:
    """The ``[8, K]`` fp32 ones ``sum_of_squares`` multiplies by (one per width and device)."""
    key = (xf.shape[-1], str(xf.device))
    ones = _ones.get(key)
    if ones is None:
        with torch.inference_mode(False):  # a normal tensor: an engine's cache may serve a trainer
            ones = _ones[key] = torch.ones(8, xf.shape[-1], dtype=torch.float32, device=xf.device)
    return ones


def sum_of_squares(xf: torch.Tensor) -> torch.Tensor:
    """``(xf * xf).sum(-1)`` for fp32 ``xf`` as one GEMM (``torch.mm``: MKL on CPU) of the rows,
    zero-padded to a multiple of 8, against an ``[8, K]`` matrix of ones: a row's sum then depends
    only on that row, whatever the batch or the thread count (the row property of ``kernels.linear``,
    asserted for this kernel by ``test_kernels.py``), in one kernel instead of a halving tree's
    log2(K) steps. MKL rather than oneDNN: for these thin products its call costs a third.
    Differentiable."""
    k = xf.shape[-1]
    ones = _ones_for(xf)
    squares = (xf * xf).reshape(-1, k)
    rows = squares.shape[0]
    padded = aligned_rows(rows)
    if padded != rows:
        squares = F.pad(squares, (0, 0, 0, padded - rows))
    return torch.mm(squares, ones.t())[:rows, 0].view(xf.shape[:-1])


def _sum_of_squares_inference(xf: torch.Tensor) -> torch.Tensor:
    """``sum_of_squares`` without autograd: the squares are written straight into the zero-padded
    GEMM operand (one buffer instead of two); the result is a fresh tensor."""
    k = xf.shape[-1]
    x2 = xf.reshape(-1, k)
    rows = x2.shape[0]
    squares = x2.new_empty(aligned_rows(rows), k)
    torch.mul(x2, x2, out=squares[:rows])
    squares[rows:].zero_()
    return torch.mm(squares, _ones_for(xf).t())[:rows, 0].view(xf.shape[:-1])


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up in fp32, rounded once. Without autograd the same operations (``silu``'s
    ``g / (1 + exp(-g))``, then ``* up``) run in one buffer: the same bits, four fewer buffers."""
    if _needs_grad(gate, up):
        return (silu(gate.float()) * up.float()).to(gate.dtype)
    g = gate.float()
    out = torch.neg(g).exp_().add_(1.0)  # 1 + exp(-g): IEEE sums commute
    torch.div(g, out, out=out)
    return out.mul_(up.float()).to(gate.dtype)


_rope_tables: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}


def _rope_table(inv_freq: torch.Tensor, scaling: float, positions: int) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 cos/sin for positions ``[0, positions)``, built in ``ROPE_TABLE_BLOCK``-position blocks of
    one shape, so that an entry never depends on how large the table is."""
    freq = inv_freq.detach().float()
    key = (freq.cpu().numpy().tobytes(), float(scaling), str(freq.device))
    cos, sin = _rope_tables.get(key, (freq.new_empty(0, 2 * freq.numel()), freq.new_empty(0, 2 * freq.numel())))
    if cos.shape[0] < positions:
        blocks_cos, blocks_sin = [cos], [sin]
        for start in range(cos.shape[0], positions, ROPE_TABLE_BLOCK):
            pos = torch.arange(start, start + ROPE_TABLE_BLOCK, device=freq.device, dtype=torch.float32)
            angles = pos[:, None] * freq[None, :]
            angles = torch.cat((angles, angles), dim=-1)
            blocks_cos.append(angles.cos() * scaling)
            blocks_sin.append(angles.sin() * scaling)
        cos, sin = torch.cat(blocks_cos), torch.cat(blocks_sin)
        _rope_tables[key] = (cos, sin)
    return cos, sin


def rope(inv_freq: torch.Tensor, attention_scaling: float, position_ids: torch.Tensor, dtype: torch.dtype):
    """(cos, sin) ``[B, T, 2 * len(inv_freq)]`` in ``dtype``, looked up in one shared table."""
    positions = position_ids.long()
    if positions.numel() and int(positions.min()) < 0:
        raise ValueError("rope: position ids must be >= 0")
    needed = int(positions.max()) + 1 if positions.numel() else 1
    cos, sin = _rope_table(inv_freq, attention_scaling, needed)
    return cos[positions].to(dtype), sin[positions].to(dtype)
