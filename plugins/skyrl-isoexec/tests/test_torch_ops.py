"""The ``isoexec::`` custom ops (for compiling engines) compute the kernels' bits, eager and compiled."""

from __future__ import annotations

import pytest
import torch

from skyrl_isoexec import torch_ops
from skyrl_isoexec.kernels import attention, elementwise, linear, logprobs
from skyrl_isoexec.parity import bits


def _inputs():
    g = torch.Generator().manual_seed(0)
    return torch.randn(6, 64, generator=g), torch.randn(32, 64, generator=g), torch.randn(32, generator=g)


def test_custom_ops_equal_the_kernels_and_differentiate():
    x, w, nw = _inputs()
    assert int((bits(torch_ops.linear(x, w, None)) != bits(linear.linear(x, w))).sum()) == 0
    h = linear.linear(x, w)
    assert int((bits(torch_ops.rms_norm(h, nw, h, 1e-6, False)) != bits(elementwise.rms_norm(h, nw, 1e-6, gate=h))).sum()) == 0
    assert int((bits(torch_ops.silu_mul(h, h)) != bits(elementwise.silu_mul(h, h))).sum()) == 0
    q = torch.randn(1, 4, 5, 32)
    kv = torch.randn(1, 2, 5, 32)
    visible = torch.ones(5, 5, dtype=torch.bool).tril()[None, None]
    assert int((bits(torch_ops.attention(q, kv, kv, visible, 0.2)) != bits(attention.attention(q, kv, kv, visible, 0.2))).sum()) == 0
    ids = torch.tensor([1, 2, 3, 4, 5, 6])
    assert int((bits(torch_ops.logprobs(h, ids, 1.0)) != bits(logprobs.logprobs(h, ids))).sum()) == 0

    xr, wr = x.clone().requires_grad_(), w.clone().requires_grad_()
    gate = h.clone().requires_grad_()
    torch_ops.rms_norm(torch_ops.linear(xr, wr, None), nw, gate, 1e-6, False).sum().backward()
    xe, we, ge = x.clone().requires_grad_(), w.clone().requires_grad_(), h.clone().requires_grad_()
    elementwise.rms_norm(linear.linear(xe, we), nw, 1e-6, gate=ge).sum().backward()
    for got, want in ((xr.grad, xe.grad), (wr.grad, we.grad), (gate.grad, ge.grad)):
        torch.testing.assert_close(got, want)


@pytest.mark.slow
def test_compiled_graph_keeps_the_bits():
    """Inductor cannot fuse into opaque ops: a compiled function equals the eager kernels bit for bit."""
    x, w, nw = _inputs()

    def block(t):
        h = torch_ops.rms_norm(torch_ops.linear(t, w, None), nw, None, 1e-6, False)
        return torch_ops.silu_mul(h, h * 2)

    compiled = torch.compile(block)(x)
    h = elementwise.rms_norm(linear.linear(x, w), nw, 1e-6)
    assert int((bits(compiled) != bits(elementwise.silu_mul(h, h * 2))).sum()) == 0
