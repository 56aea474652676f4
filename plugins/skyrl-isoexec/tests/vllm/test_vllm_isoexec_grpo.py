"""A real GRPO run with ``engine.name=vllm`` (vLLM multiprocess, skyrl-fsdp trainer, arithmetic
environment) and IsoExec on: the trainer-vs-rollout mismatch is exactly 0 at every step, also
after optimizer steps and in-place weight syncs. The other runs put vLLM in the trainer's process
(``multiprocess: false``: no engine-core and worker processes to start): with the old-logprob pass
skipped (the IsoExec default) the trainer trusts the rollout logprobs; an altered engine contract
refuses to start; IsoExec off shows the native mismatch."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("vllm")
pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[4]
TINY_QWEN3 = {
    "model_type": "qwen3", "vocab_size": 512, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32, "max_position_embeddings": 512,
}


def _run(tmp_path: Path, monkeypatch, *, enabled: bool, skip: bool, steps: int = 3, multiprocess: bool = True) -> list[dict]:

    from skyrl_core.testing.runs import train_config_dict
    from skyrl_isoexec import state

    # vLLM's cache: the session's isolated one (a fresh one per test cost a model-class inspection
    # subprocess at every engine start, ~8 s).
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    # train() switches IsoExec on through this variable (for vLLM's workers) and state.configure(None)
    # leaves it set: have monkeypatch restore it after the test (setenv records its absence; delenv of
    # an absent variable would not), or later tests in this process run with IsoExec on.
    monkeypatch.setenv(state.ENV_VAR, "0")
    config = {
        "model": {"config": TINY_QWEN3},
        "engine": {"name": "vllm", "options": {"kv_cache_memory_bytes": 32 << 20, "max_model_len": 512,
                                               "multiprocess": multiprocess}},
        "backend": {"name": "fsdp"},
        "environment": {"name": "arithmetic"},
        "data": {"train": str(REPO / "examples" / "data" / "arithmetic" / "train.jsonl"), "prompts_per_step": 4},
        "generation": {"max_new_tokens": 8, "n_samples": 4},
        "trainer": {"steps": steps, "lr": 1e-2, "mini_batches": 2, "micro_batch_size": 5, "progress": False,
                    "plot": False, "output_dir": str(tmp_path / "run")},
        "isoexec": {"enabled": enabled, "skip_old_logprob_pass": skip},
    }
    previous = state.configure(None)
    try:
        return train_config_dict(config, tmp_path)
    finally:
        state.configure(previous)


def test_grpo_with_vllm_logs_zero_mismatch_at_every_step(tmp_path, monkeypatch):
    # The old-logprob pass kept at every step, to measure the mismatch at every step.
    steps = [m for m in _run(tmp_path / "on", monkeypatch, enabled=True, skip=False) if "step" in m and m["step"] > 0]
    assert [m["step"] for m in steps] == [1, 2, 3]
    assert [m["mismatch/abs_logprob_diff_max"] for m in steps] == [0.0, 0.0, 0.0]
    assert all(m["mismatch/kl"] == 0.0 for m in steps)
    # Negative control: one step is enough, its mismatch is measured before its optimizer step; vLLM
    # in this process (stock vLLM's numerics do not depend on where its worker runs).
    off = [m for m in _run(tmp_path / "off", monkeypatch, enabled=False, skip=False, steps=1, multiprocess=False)
           if "step" in m and m["step"] > 0]
    assert [m["step"] for m in off] == [1] and off[0]["mismatch/abs_logprob_diff_max"] > 0


def test_grpo_with_vllm_skips_the_old_logprob_pass(tmp_path, monkeypatch):
    # A trainer-side choice: vLLM in this process (its multiprocess mode is the test above), 2 steps.
    steps = [m for m in _run(tmp_path / "skip", monkeypatch, enabled=True, skip=True, steps=2, multiprocess=False)
             if "step" in m and m["step"] > 0]
    assert [m["step"] for m in steps] == [1, 2]
    assert steps[0]["mismatch/abs_logprob_diff_max"] == 0.0  # measured once, at step 1
    # Later steps reuse the rollout logprobs as old logprobs: no trainer pass, nothing to compare.
    assert all("mismatch/abs_logprob_diff_max" not in m for m in steps[1:])


def test_grpo_refuses_to_start_when_the_engine_contract_is_altered(tmp_path, monkeypatch):
    from skyrl_vllm.engine import VLLMEngine

    original = VLLMEngine.execution_contract

    def altered(self):
        contract = original(self)
        ledger = contract["ledger"]
        # One site's declared attention implementation changed.
        ledger["attention@engine_decode"] = {**ledger["attention@engine_decode"], "version": "altered"}
        return contract

    monkeypatch.setattr(VLLMEngine, "execution_contract", altered)
    with pytest.raises(Exception, match=r"refusing to sync weights(.|\n)*attention @ trainer_forward vs engine_decode"):
        _run(tmp_path / "altered", monkeypatch, enabled=True, skip=True, steps=1, multiprocess=False)
    assert not (tmp_path / "altered" / "run" / "metrics.jsonl").exists() or not any(
        '"step": 1' in line for line in (tmp_path / "altered" / "run" / "metrics.jsonl").read_text().splitlines()
    )
