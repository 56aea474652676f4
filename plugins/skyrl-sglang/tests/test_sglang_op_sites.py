"""skyrl's op sites in SGLang's layers, on stand-ins for SGLang's layer classes (SGLang cannot be
installed or started without CUDA; the real layers are exercised by the gpu-marked test). The
routed forwards are the core's (``skyrl_core.ops.engine_layers``); vLLM runs them for real in
``tests/ops/test_third_party_op_plugin.py``."""

from __future__ import annotations

import attrs
import pytest
import torch
import torch.nn.functional as F

from skyrl_core.ops import OpLedger, engine_layers, site_scope
from skyrl_core.ops.dispatch import OpDispatch
from skyrl_core.ops.stock import DEFAULT_IMPLS
from skyrl_core.ops.vocabulary import OPS, ROLE_SITES
from skyrl_core.plugins.records import OpImplSpec


# --- stand-ins with SGLang's layer shapes -----------------------------------------------------------
class UnquantizedLinearMethod:
    def apply(self, layer, x, bias=None):
        return F.linear(x, layer.weight, bias) + 1000.0  # a stock kernel that is visibly not the plugin's


class LinearBase(torch.nn.Module):
    def __init__(self, k, sizes):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(sum(sizes), k), requires_grad=False)
        self.output_partition_sizes = list(sizes)
        self.quant_method = UnquantizedLinearMethod()

    def forward(self, x):
        return self.quant_method.apply(self, x, None)


class RMSNorm(torch.nn.Module):
    def __init__(self, h):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.rand(h) + 0.5, requires_grad=False)
        self.variance_epsilon = 1e-6

    def forward(self, x, residual=None):
        return (x * 0.0, residual) if residual is not None else x * 0.0


class SiluAndMul(torch.nn.Module):
    def forward(self, x):
        return x[..., : x.shape[-1] // 2] * 0.0


class Model(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.qkv = LinearBase(8, (4, 2, 2))
        self.norm = RMSNorm(8)
        self.act = SiluAndMul()


def _classes() -> engine_layers.LayerClasses:
    never = type("Never", (), {})
    return engine_layers.LayerClasses(
        linear=LinearBase, linear_method=UnquantizedLinearMethod, embedding=never, lm_head=never, embedding_method=never,
        rms_norm=(RMSNorm,), unit_offset_norm=(), gated_norm=(), silu_mul=(SiluAndMul,), rotary=(never,),
        plain_rotary=lambda m: False, plain_weight=lambda m: True,
    )


calls: list[tuple[str, tuple]] = []


def recording_linear(x, weight, bias=None):
    calls.append(("linear", tuple(weight.shape)))
    return F.linear(x, weight, bias)


def recording_rms_norm(x, weight, eps, unit_offset, gate):
    calls.append(("rms_norm", tuple(x.shape)))
    return (x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype) * weight


def recording_silu_mul(gate, up):
    calls.append(("silu_mul", tuple(gate.shape)))
    return F.silu(gate) * up


def _ledger(decode_only: bool = False) -> OpLedger:
    ledger = OpLedger(role="engine")
    for site in ROLE_SITES["engine"]:
        for op in OPS:
            ledger.declare(op, site, DEFAULT_IMPLS[op])
    for op in ("linear", "rms_norm", "silu_mul"):
        spec = OpImplSpec(name=f"test.{op}", op=op, version="1", factory=f"{__name__}:recording_{op}")
        for site in (("engine_decode",) if decode_only else ROLE_SITES["engine"]):
            ledger.declare(op, site, spec)
    return ledger


def test_routed_layers_call_the_installed_ops_with_the_trainers_shapes():
    torch.manual_seed(0)
    model, ledger = Model(), _ledger()
    record = engine_layers.route_layers(model, OpDispatch(ledger), {"linear": ["test.linear"], "rms_norm": ["test.rms_norm"],
                                                                       "silu_mul": ["test.silu_mul"]}, _classes())
    assert sorted(record.named) == ["act", "norm", "qkv"] and record.unpatched == []
    x, residual = torch.randn(3, 8), torch.randn(3, 8)
    calls.clear()
    with site_scope("engine_prefill"):
        qkv = model.qkv(x)
        normed, summed = model.norm(x, residual)
        act = model.act(torch.randn(3, 8))
    # merged q/k/v: one call per logical projection (the linear does not declare columns_independent)
    assert calls[:3] == [("linear", (4, 8)), ("linear", (2, 8)), ("linear", (2, 8))]
    assert torch.equal(qkv, F.linear(x, model.qkv.weight))  # not the stand-in's stock kernel (+1000)
    assert torch.equal(summed, residual + x) and normed.abs().sum() > 0 and act.abs().sum() > 0
    assert ledger.observed[("linear", "engine_prefill", "test.linear")] == 1
    assert ledger.observed[("rms_norm", "engine_prefill", "test.rms_norm")] == 1


def test_a_site_with_the_stock_implementation_runs_the_layers_own_kernel():
    model, ledger = Model(), _ledger(decode_only=True)
    engine_layers.route_layers(model, OpDispatch(ledger), {"linear": ["test.linear"]}, _classes())
    x = torch.randn(2, 8)
    with site_scope("engine_prefill"):  # stock there: the stand-in's own kernel
        assert torch.equal(model.qkv(x), F.linear(x, model.qkv.weight) + 1000.0)
    with site_scope("engine_decode"):
        assert torch.equal(model.qkv(x), F.linear(x, model.qkv.weight))
    assert ledger.observed[("linear", "engine_prefill", DEFAULT_IMPLS["linear"].name)] == 1


def test_a_quantized_linear_is_refused_when_linear_is_routed():
    class QuantizedMethod:
        def apply(self, layer, x, bias=None):
            return x

    model = Model()
    model.qkv.quant_method = QuantizedMethod()
    record = engine_layers.route_layers(model, OpDispatch(_ledger()), {"linear": ["test.linear"]}, _classes())
    assert record.unpatched == ["qkv (LinearBase)"]


def test_sglang_refuses_ops_it_does_not_route_and_cuda_graphs():
    from skyrl_sglang.op_sites import refusals, routed_ops

    assert routed_ops(_ledger()) == {"linear": ["test.linear"], "rms_norm": ["test.rms_norm"], "silu_mul": ["test.silu_mul"]}
    assert refusals({"linear": ["x"]}, cuda_graph=False) == []
    (graph,) = refusals({"linear": ["x"]}, cuda_graph=True)
    assert "disable_cuda_graph" in graph
    (attention,) = refusals({"attention": ["plugin.attention"]}, cuda_graph=False)
    assert attention.startswith("attention implementation plugin.attention cannot be called from SGLang's layers")
    stock = OpLedger(role="engine")
    for site in ROLE_SITES["engine"]:
        for op in OPS:
            stock.declare(op, site, DEFAULT_IMPLS[op])
    assert routed_ops(stock) == {}


@pytest.mark.gpu
def test_sglang_routes_a_real_model_on_gpu():  # pragma: no cover - needs CUDA and SGLang
    pytest.importorskip("sglang")
    from skyrl_sglang.op_sites import layer_classes

    assert layer_classes().linear.__module__.startswith("sglang.")
