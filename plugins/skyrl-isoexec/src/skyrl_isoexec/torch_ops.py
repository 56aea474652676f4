"""The canonical kernels as opaque ``isoexec::`` custom ops, for engines that compile (vLLM).

A compiler cannot fuse or reorder inside an opaque op, so a compiled engine computes exactly what
the eager trainer computes: each op calls the same kernel function (``skyrl_isoexec.kernels``).
Gradients: ``linear`` has its ordinary backward; the others differentiate the kernel again
(recomputation), so a compiled trainer keeps autograd too. Importing this module registers them.
"""

from __future__ import annotations

import torch

from skyrl_isoexec.kernels import attention as _attention
from skyrl_isoexec.kernels import elementwise as _elementwise
from skyrl_isoexec.kernels import linear as _linear
from skyrl_isoexec.kernels import logprobs as _logprobs


def _register_recompute(op, kernel, n_inputs):
    """Give ``op`` a backward that differentiates ``kernel`` again on the saved inputs (its first
    ``n_inputs`` arguments are tensors, the rest are constants)."""

    def setup(ctx, inputs, output):
        ctx.save_for_backward(*[t if isinstance(t, torch.Tensor) else None for t in inputs[:n_inputs]])
        ctx.rest = inputs[n_inputs:]

    def backward(ctx, grad):
        saved = [t.detach().requires_grad_(t.is_floating_point()) if t is not None else None for t in ctx.saved_tensors]
        with torch.enable_grad():
            out = kernel(*saved, *ctx.rest)
            wanted = [t for t in saved if t is not None and t.requires_grad]
            grads = iter(torch.autograd.grad(out, wanted, grad, allow_unused=True))
        return (*[next(grads) if t is not None and t.requires_grad else None for t in saved], *[None] * len(ctx.rest))

    op.register_autograd(backward, setup_context=setup)


@torch.library.custom_op("isoexec::linear", mutates_args=())
def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return _linear.linear(x, weight, bias)


@linear.register_fake
def _(x, weight, bias):
    return x.new_empty(*x.shape[:-1], weight.shape[0])


def _linear_setup(ctx, inputs, output):
    x, weight, bias = inputs
    ctx.save_for_backward(x, weight)
    ctx.has_bias = bias is not None


def _linear_backward(ctx, grad):
    x, weight = ctx.saved_tensors
    grad_x = grad @ weight
    grad_w = grad.reshape(-1, grad.shape[-1]).t() @ x.reshape(-1, x.shape[-1])
    grad_b = grad.reshape(-1, grad.shape[-1]).sum(0) if ctx.has_bias else None
    return grad_x, grad_w, grad_b


linear.register_autograd(_linear_backward, setup_context=_linear_setup)


def _rms_norm(x, weight, gate, eps, unit_offset):
    return _elementwise.rms_norm(x, weight, eps, unit_offset, gate)


@torch.library.custom_op("isoexec::rms_norm", mutates_args=())
def rms_norm(x: torch.Tensor, weight: torch.Tensor, gate: torch.Tensor | None, eps: float, unit_offset: bool) -> torch.Tensor:
    """Note the argument order: tensors first (``gate`` may be None), then the constants."""
    return _rms_norm(x, weight, gate, eps, unit_offset)


@rms_norm.register_fake
def _(x, weight, gate, eps, unit_offset):
    return torch.empty_like(x)


_register_recompute(rms_norm, _rms_norm, 3)


@torch.library.custom_op("isoexec::silu_mul", mutates_args=())
def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return _elementwise.silu_mul(gate, up)


@silu_mul.register_fake
def _(gate, up):
    return torch.empty_like(gate)


_register_recompute(silu_mul, _elementwise.silu_mul, 2)


@torch.library.custom_op("isoexec::attention", mutates_args=())
def attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, visible: torch.Tensor, scaling: float) -> torch.Tensor:
    return _attention.attention(query, key, value, visible, scaling)


@attention.register_fake
def _(query, key, value, visible, scaling):
    b, h, tq, d = query.shape
    return query.new_empty(b, tq, h, d)


_register_recompute(attention, _attention.attention, 4)


@torch.library.custom_op("isoexec::logprobs", mutates_args=())
def logprobs(logits: torch.Tensor, token_ids: torch.Tensor, temperature: float) -> torch.Tensor:
    return _logprobs.logprobs(logits, token_ids, temperature)


@logprobs.register_fake
def _(logits, token_ids, temperature):
    return logits.new_empty(token_ids.shape, dtype=torch.float32)


_register_recompute(logprobs, _logprobs.logprobs, 2)
