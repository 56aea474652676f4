"""bf16 linear as fp32 products (``skyrl_core.ops.fp32_products``): the bits of an fp32 product of
the bf16 operands rounded once, forward and both gradients; chosen by ``linear_defaults`` exactly
where oneDNN has no bf16 products."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from skyrl_core.ops import gemm_choice, onednn
from skyrl_core.ops.fp32_products import FP32_PRODUCTS_LINEAR, linear


def _operands(m: int = 48, k: int = 1536, n: int = 320):
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(2, m // 2, k, generator=gen).bfloat16().requires_grad_()
    w = (torch.randn(n, k, generator=gen) / k**0.5).bfloat16().requires_grad_()
    b = torch.randn(n, generator=gen).bfloat16().requires_grad_()
    return x, w, b


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int16)


def test_forward_and_gradients_are_fp32_products_rounded_to_bf16():
    x, w, b = _operands()
    y = linear(x, w, b)
    assert y.dtype == torch.bfloat16 and y.shape == (2, 24, 320)
    grad = torch.randn(y.shape, generator=torch.Generator().manual_seed(1)).bfloat16()
    gx, gw, gb = torch.autograd.grad(y, (x, w, b), grad)

    # the reference: the same products in fp32 on PyTorch's BLAS, rounded once
    ref_y = F.linear(x.detach().float(), w.detach().float(), b.detach().float()).bfloat16()
    g32 = grad.reshape(-1, 320).float()
    ref_gx = (g32 @ w.detach().float()).bfloat16().reshape(x.shape)
    ref_gw = (g32.t() @ x.detach().reshape(-1, 1536).float()).bfloat16()
    ref_gb = g32.sum(0).bfloat16()
    for got, ref in ((y, ref_y), (gx, ref_gx), (gw, ref_gw), (gb, ref_gb)):
        assert got.dtype == torch.bfloat16 and torch.equal(_bits(got), _bits(ref))

    # and the same mathematics as PyTorch's bf16 linear: within bf16 rounding of it
    stock = F.linear(x, w, b)
    sx, sw, sb = torch.autograd.grad(stock, (x, w, b), grad)
    for got, ref in ((y, stock), (gx, sx), (gw, sw), (gb, sb)):
        scale = ref.float().abs().max().item()
        assert (got.float() - ref.float()).abs().max().item() <= 2 ** -6 * scale
    # negative control: PyTorch's bf16 kernels sum in another order, so the bit check above sees
    # which path ran (a bug falling back to them would fail it)
    assert any(not torch.equal(_bits(s), _bits(r)) for s, r in ((stock, ref_y), (sx, ref_gx), (sw, ref_gw)))


def test_other_dtypes_and_devices_take_f_linear_unchanged():
    x, w = torch.randn(4, 64), torch.randn(8, 64)
    assert torch.equal(linear(x, w).view(torch.int32), F.linear(x, w).view(torch.int32))


@pytest.mark.parametrize("oneDNN_bf16", [True, False])
def test_linear_defaults_take_it_for_bf16_only_where_onednn_has_no_bf16(monkeypatch, oneDNN_bf16):
    real = onednn.computes
    monkeypatch.setattr(onednn, "computes", lambda dtype: oneDNN_bf16 if dtype == torch.bfloat16 else real(dtype))
    expected = {} if oneDNN_bf16 else {"linear": FP32_PRODUCTS_LINEAR}
    assert gemm_choice.linear_defaults("onednn", torch.bfloat16) == expected
    assert gemm_choice.linear_defaults("torch", torch.bfloat16) == expected  # cpu_gemm names the fp32 library
    assert gemm_choice.linear_defaults("onednn", torch.bfloat16, "cuda") == {}
    assert gemm_choice.linear_defaults("torch", torch.float32) == {}


def test_this_cpu_gets_what_its_onednn_can_do():
    chosen = gemm_choice.linear_defaults("onednn", torch.bfloat16)
    assert (chosen == {"linear": FP32_PRODUCTS_LINEAR}) is (not onednn.computes(torch.bfloat16))
