"""Which ops skyrl-vllm routes through vLLM's layers, decided from the engine's op ledger (no vLLM
process started; the routing itself runs inside vLLM in ``tests/ops/test_third_party_op_plugin.py``)."""

from __future__ import annotations

import attrs
import pytest

from skyrl_core.ops import OpLedger, engine_forms
from skyrl_core.ops.stock import DEFAULT_IMPLS
from skyrl_core.ops.vocabulary import OPS, ROLE_SITES


def _ledger(**replaced: str) -> OpLedger:
    ledger = OpLedger(role="engine")
    for site in ROLE_SITES["engine"]:
        for op in OPS:
            impl = DEFAULT_IMPLS[op]
            ledger.declare(op, site, attrs.evolve(impl, name=replaced[op]) if op in replaced else impl)
    return ledger


def test_nothing_is_routed_when_every_op_is_stock():
    from skyrl_vllm.op_sites import routed_ops

    assert routed_ops(_ledger()) == {}


def test_a_plugins_linear_is_routed_and_own_layer_implementations_are_left_to_their_plugin():
    from skyrl_vllm.op_sites import routed_ops

    assert routed_ops(_ledger(linear="counting.linear")) == {"linear": ["counting.linear"]}
    engine_forms.declare_own_layers("vllm", ["own.linear", "own.attention"], "test-plugin")
    try:
        assert routed_ops(_ledger(linear="own.linear", attention="own.attention")) == {}
        assert routed_ops(_ledger(linear="own.linear", rms_norm="other.rms_norm")) == {"rms_norm": ["other.rms_norm"]}
    finally:
        engine_forms.forget_own_layers("vllm", "test-plugin")
    assert routed_ops(_ledger(linear="own.linear")) == {"linear": ["own.linear"]}  # forgotten


@pytest.mark.parametrize("op", ["attention", "moe_experts", "gdn_core"])
def test_ops_over_vllms_own_state_are_refused_without_own_layers(op):
    from skyrl_vllm.op_sites import refusals, routed_ops

    problems = refusals(routed_ops(_ledger(**{op: f"plugin.{op}"}, linear="counting.linear")))
    assert len(problems) == 1
    assert problems[0].startswith(f"{op} implementation plugin.{op} has no vLLM layers of its own")
    assert refusals(routed_ops(_ledger(linear="counting.linear"))) == []


def test_a_plugins_own_layer_implementations_are_listed_for_the_engine():
    # With only own-layer implementations installed nothing is routed, but the engine still names its
    # steps' sites (op_sites' load_model), which those layers read.
    engine_forms.declare_own_layers("vllm", ["own.attention"], "test-plugin")
    try:
        ledger = _ledger(attention="own.attention", linear="counting.linear")
        assert engine_forms.own_layer_impls(ledger, "vllm") == ["own.attention"]
        assert engine_forms.own_layer_impls(ledger, "sglang") == []
        assert engine_forms.own_layer_impls(_ledger(linear="counting.linear"), "vllm") == []
    finally:
        engine_forms.forget_own_layers("vllm", "test-plugin")


def test_vllms_dummy_runs_are_left_out_of_the_ledger():
    from types import SimpleNamespace

    from skyrl_vllm.op_sites import _unobserved

    ledger = _ledger(linear="counting.linear")
    runner = SimpleNamespace(model=SimpleNamespace(_skyrl_dispatch=SimpleNamespace(ledger=ledger)))
    ledger.observe("linear", "engine_decode", "counting.linear", "model.layers.0.mlp.down_proj")

    def dummy_run(tokens):
        ledger.observe("linear", "unscoped", "torch.linear", "model.layers.0.mlp.down_proj")
        return tokens * 2

    assert _unobserved(runner, dummy_run)(3) == 6
    assert dict(ledger.observed) == {("linear", "engine_decode", "counting.linear"): 1}
    assert ledger.ran_modules == {("engine_decode", "model.layers.0.mlp.down_proj")}
    ledger.observe("linear", "unscoped", "torch.linear")  # a call outside a step, not a dummy run: kept
    assert ledger.as_dict()["model"]["unscoped_calls"] == {"linear": 1}


@pytest.mark.parametrize("route", [True, False])
def test_each_model_load_offers_its_two_moments_to_the_plugins(builtin_plugin_manager, monkeypatch, route):
    from types import SimpleNamespace

    from skyrl_core.plugins import hookimpl
    from skyrl_vllm import op_sites

    calls = []

    class Recorder:
        @hookimpl
        def skyrl_engine_model_loading(self, engine, engine_config):
            calls.append(("loading", engine, engine_config))
            if engine_config == "unsupported":
                raise ValueError("this plugin cannot run under this config")

        @hookimpl
        def skyrl_engine_model_loaded(self, engine, model):
            calls.append(("loaded", engine, model))

    builtin_plugin_manager.register_plugin(Recorder(), "recorder")
    monkeypatch.setattr(op_sites, "_forget_routed_rotary_embeddings", lambda: None)  # vLLM's rotary cache: not built here
    monkeypatch.setattr(op_sites, "_routing", [route])

    def vllm_load_model(runner, tag):
        calls.append(("load", tag))
        runner.model = f"model {tag}"
        return tag

    load_model = op_sites._wrap_load_model(vllm_load_model)
    runner = SimpleNamespace(vllm_config="config", model=None)
    assert load_model(runner, "a") == "a"
    assert calls == [("loading", "vllm", "config"), ("load", "a"), ("loaded", "vllm", "model a")]
    calls.clear()
    runner.vllm_config = "unsupported"
    with pytest.raises(ValueError, match="cannot run under this config"):
        load_model(runner, "b")
    assert calls == [("loading", "vllm", "unsupported")]  # refused before vLLM built anything
