"""End to end: GRPO on a tiny model raises the reward of a task it can learn."""

from __future__ import annotations

import json

import pytest

from skyrl_core.config.loader import load_config
from skyrl_core.trainer.metrics import read_metrics
from skyrl_core.trainer.rl import train
from tests.e2e.tiny_run import write_tiny_config
from tests.rollout.envs import TestEnvironments


@pytest.mark.slow
def test_tiny_grpo_run_raises_reward_and_writes_its_outputs(tmp_path, fresh_plugin_manager) -> None:
    fresh_plugin_manager.register_plugin(TestEnvironments(), "test-envs")
    config = write_tiny_config(tmp_path, steps=10, eval_every=5)
    result = train(load_config(str(config), plugin_manager=fresh_plugin_manager), plugin_manager=fresh_plugin_manager)

    records = read_metrics(result.run_dir)
    assert [r["step"] for r in records] == list(range(11))  # step 0: the evaluation before training
    steps = records[1:]
    early = sum(r["reward/mean"] for r in steps[:3]) / 3
    late = sum(r["reward/mean"] for r in steps[-3:]) / 3
    assert late > early + 0.15, (early, late)
    assert result.eval_after["eval/accuracy"] > result.eval_before["eval/accuracy"]
    for r in steps:
        for key in ("loss", "grad_norm", "lr", "entropy", "response_length/mean", "time/rollout", "time/train",
                    "mismatch/abs_logprob_diff_mean", "mismatch/abs_logprob_diff_max", "policy/ratio_mean"):
            assert key in r, key
        # fp32 engine vs fp32 trainer: the same weights, different kernels -> tiny but real mismatch
        assert 0 <= r["mismatch/abs_logprob_diff_max"] < 1e-3
        assert r["lr"] == pytest.approx(1e-2)
    assert {"eval/accuracy", "eval/pass@1"} <= set(records[5]) and "eval/accuracy" not in records[4]
    assert (tmp_path / "run" / "metrics.png").stat().st_size > 1000
    assert (tmp_path / "run" / "checkpoints" / "latest").read_text().strip() == "step_000010"
    assert json.loads((tmp_path / "run" / "checkpoints" / "step_000010" / "trainer_state.json").read_text())["step"] == 10
