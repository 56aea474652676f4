"""The execution contract: canonical serialisation, hashing, the handshake, the fingerprint check."""

from __future__ import annotations

import copy

import pytest
import torch

from skyrl_core.ops import site_scope
from skyrl_isoexec import state
from skyrl_isoexec.contract import ContractMismatch, build_contract, canonical_json, compare, handshake, sha256
from skyrl_isoexec.parity import build_model, decode_logprobs, full_logprobs, random_sequences


def test_canonical_json_sorts_keys_and_writes_floats_as_bits():
    assert canonical_json({"b": 1, "a": [0.5, "x"]}) == '{"a":["f64:3fe0000000000000","x"],"b":1}'
    assert sha256({"a": 0.1}) != sha256({"a": 0.1 + 2**-56})  # one ulp apart: another contract
    assert sha256({"x": 1, "y": 2}) == sha256({"y": 2, "x": 1})


def _contracts(enabled=True, family="qwen3"):
    """(trainer, engine) contributions after each runtime computed at its sites."""
    trainer, trainer_ledger = build_model(family, "float32", enabled=enabled, role="trainer")
    engine, engine_ledger = build_model(family, "float32", enabled=enabled, role="engine")
    sequence = random_sequences((9,))[0]
    full_logprobs(trainer, trainer_ledger, [sequence])
    full_logprobs(trainer, trainer_ledger, [sequence], site="trainer_forward")
    decode_logprobs(engine, engine_ledger, sequence, prefill=3)
    with state.enabled_scope(enabled):
        return (
            build_contract("trainer", trainer_ledger.as_dict(), enabled=enabled),
            build_contract("engine", engine_ledger.as_dict(), enabled=enabled),
            engine,
            engine_ledger,
        )


def test_matching_runtimes_agree_and_record_what_ran():
    trainer, engine, _, _ = _contracts()
    assert trainer["hash"] == engine["hash"]
    assert trainer["fingerprint"] == [] and engine["fingerprint"] == []
    assert compare({"isoexec": trainer}, {"isoexec": engine}) == []
    assert trainer["identity"]["ops"]["linear"]["impl"] == "isoexec.linear"
    assert "threads" not in trainer["identity"]  # canonical ops are thread-count invariant


def test_a_tampered_contract_refuses_naming_the_op_site_pairs():
    trainer, engine, _, _ = _contracts()
    forged = copy.deepcopy(engine)
    forged["identity"]["ops"]["attention"]["constants"]["key_block"] = 128
    problems = compare(trainer, forged)
    assert any("hash" in p and "does not match its content" in p for p in problems)
    pairs = [p for p in problems if p.startswith("attention @ ")]
    assert len(pairs) == 4 and "attention @ trainer_score vs engine_decode" in " ".join(pairs)
    # A consistent forgery (hash recomputed) is still a different contract.
    forged["hash"] = sha256(forged["identity"])
    problems = compare(trainer, forged)
    assert problems and all(p.startswith("attention @ ") for p in problems)
    with pytest.raises(ContractMismatch, match="attention @ trainer_forward vs engine_prefill"):
        handshake(trainer, forged)


def test_stock_against_canonical_refuses_and_off_on_both_sides_is_inert():
    trainer, _, _, _ = _contracts(enabled=True)
    off_trainer, off_engine, _, _ = _contracts(enabled=False)
    problems = compare(trainer, off_engine)
    assert any("not in the engine" in p for p in problems)
    assert any(p.startswith("linear @ ") and "torch.linear" in p for p in problems)
    assert compare(off_trainer, off_engine) == []
    assert "threads" in off_trainer["identity"]  # stock GEMM bits depend on the thread count


def test_environment_differences_are_reported():
    trainer, engine, _, _ = _contracts()
    other = copy.deepcopy(engine)
    other["identity"]["environment"]["dtype"] = "bfloat16"
    other["hash"] = sha256(other["identity"])
    assert any(p.startswith("environment dtype") for p in compare(trainer, other))


def test_fingerprint_catches_a_declared_but_not_installed_op():
    _, _, engine, ledger = _contracts()
    norm = engine.model.layers[0].input_layernorm
    norm.forward = norm._skyrl_stock_forward  # the module computes stock numerics, bypassing dispatch
    ledger.ran_modules.clear()
    with torch.no_grad(), site_scope("engine_decode"):
        engine(input_ids=torch.tensor([[5, 6]]))
    with state.enabled_scope(True):
        contract = build_contract("engine", ledger.as_dict(), enabled=True)
    assert any("model.layers.0.input_layernorm" in p for p in contract["fingerprint"])
    other, _, _, _ = _contracts()
    assert any("engine fingerprint" in p for p in compare(other, contract))


def test_fingerprint_catches_stock_ops_and_unscoped_calls():
    _, _, engine, ledger = _contracts()
    ledger.observe("rms_norm", "engine_decode", "torch.rms_norm")
    with torch.no_grad():
        engine(input_ids=torch.tensor([[5, 6]]))  # outside any site_scope
    with state.enabled_scope(True):
        problems = build_contract("engine", ledger.as_dict(), enabled=True)["fingerprint"]
    assert any("rms_norm @ engine_decode: declared isoexec.rms_norm but torch.rms_norm x1 ran" in p for p in problems)
    assert any("outside any op site" in p for p in problems)


def test_hooks_through_the_plugin_manager():
    """The installed plugin answers the core's hooks: contract contribution and handshake."""
    from skyrl_core.plugins.manager import get_plugin_manager

    pm = get_plugin_manager()
    trainer, engine, _, _ = _contracts()
    answers = pm.hook.skyrl_verify_handshake(trainer_contract={"isoexec": trainer}, engine_contract={"isoexec": engine})
    assert [a.mismatches for a in answers] == [()]
    with state.enabled_scope(True):
        chosen = pm.hook.skyrl_install_op(op="linear", site="engine_decode", impl=None)
    assert chosen.name == "isoexec.linear"
    with state.enabled_scope(False):
        from skyrl_core.ops.install import DEFAULT_IMPLS

        assert pm.hook.skyrl_install_op(op="linear", site="engine_decode", impl=DEFAULT_IMPLS["linear"]).name == "torch.linear"


def test_enabled_after_the_runtimes_were_built_refuses():
    """IsoExec switched on (e.g. by the run config) after a runtime prepared stock ops: fail closed."""
    trainer, _, _, _ = _contracts(enabled=True)
    _, _, _, engine_ledger = _contracts(enabled=False)
    stale = build_contract("engine", engine_ledger.as_dict(), enabled=True)
    assert any("IsoExec is on but linear has torch.linear installed" in p for p in stale["fingerprint"])
    assert compare(trainer, stale)


def _verdict(enabled: bool, skip: bool = True, tamper: bool = False):
    from skyrl_isoexec.config import IsoExecConfig
    from skyrl_isoexec.plugin import skyrl_verify_handshake

    trainer, engine, _, _ = _contracts(enabled=enabled)
    if tamper:
        engine = copy.deepcopy(engine)
        engine["identity"]["ops"]["attention"]["constants"]["key_block"] = 128
    saved = state.configure(IsoExecConfig(enabled=enabled, skip_old_logprob_pass=skip))
    try:
        return skyrl_verify_handshake(trainer_contract={"isoexec": trainer}, engine_contract={"isoexec": engine})
    finally:
        state.configure(saved)


def test_the_verdict_vouches_for_identical_logprobs_only_when_isoexec_is_on_and_agrees():
    """The RL loop skips its old-logprob pass on this verdict alone (it knows no plugin by name)."""
    on = _verdict(enabled=True)
    assert (on.mismatches, on.identical_logprobs, on.reuse_rollout_logprobs) == ((), True, True)
    no_skip = _verdict(enabled=True, skip=False)
    assert (no_skip.identical_logprobs, no_skip.reuse_rollout_logprobs) == (True, False)
    off = _verdict(enabled=False)
    assert (off.mismatches, off.identical_logprobs, off.reuse_rollout_logprobs) == ((), False, False)
    tampered = _verdict(enabled=True, tamper=True)
    assert tampered.mismatches and not tampered.identical_logprobs and not tampered.reuse_rollout_logprobs
