"""The layer spec a Megatron rank builds (``skyrl_megatron.layer_spec``): Transformer Engine's fused
layers only where they can run and no op plugin needs megatron's local layers. CPU-only: the
decision itself, and what ``installed_trainer_ops`` reports with IsoExec on and off (the GPU side:
``test_gpu.py::test_isoexec_builds_local_layers_in_bf16_where_transformer_engine_is_installed``)."""

import logging

import pytest

from skyrl_megatron.layer_spec import LOCAL, TRANSFORMER_ENGINE, choose_layer_spec, installed_trainer_ops, log_choice

ISOEXEC_OPS = ("linear@trainer_forward (isoexec.linear)",)


@pytest.mark.parametrize(
    ("device", "te", "model_type", "ops", "spec", "reason"),
    [
        ("cuda", True, "qwen3", (), TRANSFORMER_ENGINE, "CUDA with transformer_engine installed"),
        ("cuda", True, "qwen3_moe", ISOEXEC_OPS, LOCAL, "installed op implementations (linear@trainer_forward"),
        ("cuda", False, "qwen3", (), LOCAL, "transformer_engine is not installed"),
        ("cuda", True, "qwen3_next", (), LOCAL, "Qwen3-Next hybrid is built from local modules"),
        ("cpu", True, "llama", (), LOCAL, "device cpu"),
        ("cpu", False, "llama", ISOEXEC_OPS, LOCAL, "device cpu"),
    ],
)
def test_transformer_engine_only_where_it_runs_and_no_op_plugin_needs_local_layers(device, te, model_type, ops, spec, reason):
    choice = choose_layer_spec(device_type=device, te_available=te, model_type=model_type, installed_ops=ops)
    assert choice.spec == spec and reason in choice.reason
    assert choice.transformer_engine == (spec == TRANSFORMER_ENGINE)
    # Only passing TE over for installed ops is logged: the other local choices are not choices.
    assert choice.te_passed_over == (device == "cuda" and te and model_type != "qwen3_next" and bool(ops))


def test_passing_transformer_engine_over_is_logged_once_on_rank_0(caplog):
    choice = choose_layer_spec(device_type="cuda", te_available=True, model_type="qwen3", installed_ops=ISOEXEC_OPS * 4)
    assert "and 1 more" in choice.reason
    with caplog.at_level(logging.WARNING, logger="skyrl_megatron.layer_spec"):
        log_choice(choice, rank=1, dtype="bfloat16")
        assert not caplog.records
        log_choice(choice, rank=0, dtype="bfloat16")
        log_choice(choose_layer_spec(device_type="cuda", te_available=True, model_type="qwen3", installed_ops=()),
                   rank=0, dtype="bfloat16")
    assert [r.getMessage() for r in caplog.records] == [f"megatron backend (bfloat16): {choice.reason}"]


def test_isoexec_on_installs_trainer_ops_and_off_installs_none():
    pytest.importorskip("skyrl_isoexec", reason="skyrl-isoexec is not installed")
    from skyrl_isoexec import state

    with state.enabled_scope(False):
        assert installed_trainer_ops() == ()
    with state.enabled_scope(True):
        on = installed_trainer_ops()
    sites = {entry.split("@")[1].split()[0] for entry in on}
    assert sites == {"trainer_forward", "trainer_score"}
    assert any(entry.startswith("linear@") for entry in on) and any(entry.startswith("attention@") for entry in on)

