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
