"""``onednn.linear``: the same products as ``F.linear`` in another kernel, and how runtimes choose it."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

from skyrl_core.ops import onednn
from skyrl_core.ops.install import DEFAULT_IMPLS, prepare_model

pytestmark = pytest.mark.skipif(not onednn.available(), reason="this PyTorch has no oneDNN linear kernel")


def _operands(dtype=torch.float32):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 37, 96, generator=g).to(dtype).requires_grad_()
    w = torch.randn(200, 96, generator=g).to(dtype).requires_grad_()
    b = torch.randn(200, generator=g).to(dtype).requires_grad_()
    grad = torch.randn(3, 37, 200, generator=g).to(dtype)
    return x, w, b, grad


def _run(fn, x, w, b, grad):
    for t in (x, w, b):
        t.grad = None
    out = fn(x, w, b)
    out.backward(grad)
    return out.detach(), x.grad, w.grad, b.grad


def test_forward_and_all_gradients_agree_with_f_linear_to_fp32_rounding():
    x, w, b, grad = _operands()
    ours = _run(onednn.linear, x, w, b, grad)
    ref = _run(F.linear, x, w, b, grad)
    exact = _run(F.linear, *(t.detach().double().requires_grad_() for t in (x, w, b)), grad.double())
    for name, o, r, e in zip(("out", "grad_x", "grad_w", "grad_b"), ours, ref, exact):
        assert o.shape == r.shape and o.dtype == torch.float32, name
        scale = float(e.abs().max())
        # as close to the exact product as the BLAS result is (both are fp32 accumulations)
        assert float((o.double() - e).abs().max()) <= 8 * max(float((r.double() - e).abs().max()), 1e-7 * scale), name


def test_it_is_really_another_kernel():
    # Negative control for the test above: oneDNN's summation order differs from MKL's somewhere,
    # so equal bits everywhere would mean F.linear was called.
    g = torch.Generator().manual_seed(1)
    x, w = torch.randn(256, 576, generator=g), torch.randn(1536, 576, generator=g)
    ours, ref = onednn.linear(x, w), F.linear(x, w)
    assert torch.allclose(ours, ref, rtol=1e-4, atol=1e-4)
    if torch.equal(ours.view(torch.int32), ref.view(torch.int32)):
        pytest.skip("oneDNN and the BLAS happen to agree bit for bit on this CPU")
    assert int((ours.view(torch.int32) != ref.view(torch.int32)).sum()) > 0


def test_bf16_and_no_grad_take_the_paths_they_should():
    x, w, b, _ = _operands(torch.bfloat16)
    assert torch.equal(onednn.linear(x, w, b).view(torch.int16), F.linear(x, w, b).view(torch.int16))  # F.linear itself
    x, w, b, _ = _operands()
    with torch.no_grad():
        out = onednn.linear(x, w, b)
    assert not out.requires_grad and out.shape == (3, 37, 200)


def test_a_runtime_default_goes_through_the_install_hook_into_the_ledger(builtin_plugin_manager):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1, head_dim=16)
    torch.manual_seed(0)
    stock, fast = LlamaForCausalLM(cfg).eval(), LlamaForCausalLM(copy.deepcopy(cfg)).eval()  # patching sets the config's attention
    fast.load_state_dict(stock.state_dict())
    stock_ledger = prepare_model(stock, "trainer", plugin_manager=builtin_plugin_manager)
    fast_ledger = prepare_model(fast, "trainer", plugin_manager=builtin_plugin_manager, defaults={"linear": onednn.ONEDNN_LINEAR})
    assert stock_ledger.impl("linear", "trainer_forward") == DEFAULT_IMPLS["linear"]
    assert fast_ledger.impl("linear", "trainer_forward").name == "onednn.linear"
    ids = torch.randint(0, 64, (2, 9), generator=torch.Generator().manual_seed(2))
    from skyrl_core.ops import site_scope

    with site_scope("trainer_forward"):
        a, b = stock(ids).logits, fast(ids).logits
    assert torch.allclose(a, b, atol=1e-5)
    observed = {key: value for key, value in fast_ledger.as_dict().items() if key.startswith("linear@")}
    assert observed["linear@trainer_forward"]["impl"] == "onednn.linear"
    assert sum(observed["linear@trainer_forward"]["calls"].values()) == 8  # q, k, v, o, gate, up, down, lm_head


def test_bf16_prepack_is_opt_in_and_gives_the_plain_weights_bits():
    """bf16 weights are prepacked only when asked (``bf16=True``) and oneDNN computes
    bf16 on this CPU; ``mm_nt``/``mm_nt_add`` then give the plain weight's bits at any row count."""
    g = torch.Generator().manual_seed(1)
    w = torch.randn(200, 96, generator=g).bfloat16()
    assert onednn.prepack(w) is None  # default: fp32 only (IsoExec's bf16 linear is torch.mm)
    packed = onednn.prepack(w, bf16=True)
    if not onednn.bf16_supported():
        assert packed is None
        return
    for rows in (1, 7, 64, 300):
        x = torch.randn(rows, 96, generator=g).bfloat16()
        addend = torch.randn(rows, 200, generator=g).bfloat16()
        assert torch.equal(onednn.mm_nt(x, packed).view(torch.int16), onednn.mm_nt(x, w).view(torch.int16))
        plain_add = onednn.mm_nt_add(x, w, None, addend)
        assert torch.equal(onednn.mm_nt_add(x, packed, None, addend).view(torch.int16), plain_add.view(torch.int16))
    # It really is another tensor: oneDNN's opaque layout, which no plain product can read.
    assert packed.is_mkldnn and not w.is_mkldnn
    with pytest.raises(NotImplementedError):
        torch.mm(x, packed.t())


def test_computes_names_the_dtypes_onednn_multiplies_on_this_cpu():
    """fp32 wherever oneDNN is available, bf16 only where it has bf16 products (AVX-512 or newer):
    on an AVX2-only CPU creating a bf16 inner product fails, which ``computes`` must foresee."""
    assert onednn.computes(torch.float32) == onednn.available()
    assert onednn.computes(torch.bfloat16) == onednn.bf16_supported()
    assert not onednn.computes(torch.float16)
    x, w = torch.randn(4, 32).bfloat16(), torch.randn(8, 32).bfloat16()
    if onednn.computes(torch.bfloat16):
        assert onednn.mm_nt(x, w).shape == (4, 8)
    else:  # what the engine's choice avoids
        with pytest.raises(RuntimeError, match="primitive descriptor"):
            onednn.mm_nt(x, w)
