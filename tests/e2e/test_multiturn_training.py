"""The trainer on a multi-turn tool environment, whole episodes and step-wise."""

from __future__ import annotations

import pytest

from skyrl_core.config.loader import load_config
from skyrl_core.trainer.metrics import read_metrics
from skyrl_core.trainer.rl import train
from tests.e2e.tiny_run import write_tiny_config
from tests.rollout.envs import TestEnvironments


@pytest.mark.slow
@pytest.mark.parametrize("stepwise", [False, True])
def test_multi_turn_training_steps(tmp_path, fresh_plugin_manager, monkeypatch, stepwise) -> None:
    from skyrl_fsdp.backend import FSDPBackend

    fresh_plugin_manager.register_plugin(TestEnvironments(), "test-envs")
    trained_rows: list[int] = []
    original = FSDPBackend.forward_backward

    def counting(self, batch, loss_fn, temperature=1.0):
        trained_rows.append(len(batch))
        return original(self, batch, loss_fn, temperature)

    monkeypatch.setattr(FSDPBackend, "forward_backward", counting)
    config = write_tiny_config(tmp_path, env="counter_tool", steps=2, mini_batches=1)
    cfg = load_config(str(config), [
        "data.prompts_per_step=2", "generation.n_samples=4", "data.eval=null",
        "rollout.max_turns=3", f"rollout.stepwise={str(stepwise).lower()}",
    ], plugin_manager=fresh_plugin_manager)
    records = read_metrics(train(cfg, plugin_manager=fresh_plugin_manager).run_dir)
    assert [r["step"] for r in records] == [1, 2]
    for r in records:
        assert r["turns/mean"] == 3.0  # the tool environment always takes 3 turns
        assert {"loss", "grad_norm", "mismatch/abs_logprob_diff_max"} <= set(r)
    # 8 episodes per step: 8 training rows, or 24 (one per turn) step-wise
    assert sum(trained_rows) == 2 * (24 if stepwise else 8)
