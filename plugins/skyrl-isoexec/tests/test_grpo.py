"""A real GRPO run (skyrl-torch engine, skyrl-fsdp trainer, arithmetic environment) with IsoExec on:
the trainer-vs-rollout logprob mismatch the trainer logs is exactly 0 at every step, including
after optimizer steps and weight syncs; with IsoExec off it is not."""

from __future__ import annotations

from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[3]
TINY_QWEN3 = {
    "model_type": "qwen3", "vocab_size": 512, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32, "max_position_embeddings": 512,
}


def _run(tmp_path: Path, enabled: bool) -> list[dict]:
    import torch

    from skyrl_core.testing.runs import train_config_dict
    from skyrl_isoexec import state

    data = REPO / "examples" / "data" / "arithmetic" / "train.jsonl"
    config = {
        "model": {"config": TINY_QWEN3},
        "engine": {"name": "torch"},
        "backend": {"name": "fsdp"},
        "environment": {"name": "arithmetic"},
        "data": {"train": str(data), "prompts_per_step": 4},
        "generation": {"max_new_tokens": 8, "n_samples": 4},
        "trainer": {"steps": 3, "lr": 1e-2, "mini_batches": 2, "micro_batch_size": 5, "progress": False,
                    "plot": False, "output_dir": str(tmp_path / "run")},
        # Measure the mismatch at every step (the skip would measure it at step 1 only).
        "isoexec": {"enabled": enabled, "skip_old_logprob_pass": False},
    }
    torch.set_num_threads(1)
    previous = state.configure(None)
    try:
        return train_config_dict(config, tmp_path)
    finally:
        state.configure(previous)


@pytest.mark.slow
def test_grpo_logs_zero_mismatch_at_every_step(tmp_path):
    steps = [m for m in _run(tmp_path / "on", enabled=True) if "mismatch/abs_logprob_diff_max" in m]
    assert [m["step"] for m in steps] == [1, 2, 3]
    assert [m["mismatch/abs_logprob_diff_max"] for m in steps] == [0.0, 0.0, 0.0]
    assert all(m["mismatch/kl"] == 0.0 for m in steps)
    off = [m for m in _run(tmp_path / "off", enabled=False) if "mismatch/abs_logprob_diff_max" in m]
    assert max(m["mismatch/abs_logprob_diff_max"] for m in off) > 0  # negative control
