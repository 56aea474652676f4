"""End to end: PPO with a critic and GAE on a tiny model: the critic learns, the reward rises."""

from __future__ import annotations

import os

import pytest

from skyrl_core.config.loader import load_config
from skyrl_core.trainer.metrics import read_metrics
from skyrl_core.trainer.rl import train
from tests.e2e.tiny_run import write_tiny_config
from tests.rollout.envs import TestEnvironments


@pytest.mark.slow
def test_ppo_with_gae_trains_the_critic_and_raises_reward(tmp_path, fresh_plugin_manager) -> None:
    fresh_plugin_manager.register_plugin(TestEnvironments(), "test-envs")
    config = str(write_tiny_config(tmp_path, steps=8, mini_batches=1, checkpoint_every=4))
    cfg = load_config(config, ["data.eval=null", "algorithm.advantage=gae", "algorithm.critic.enabled=true",
                               "algorithm.critic.lr=3e-3"], plugin_manager=fresh_plugin_manager)
    records = read_metrics(train(cfg, plugin_manager=fresh_plugin_manager).run_dir)
    assert [r["step"] for r in records] == list(range(1, 9))
    reward = [r["reward/mean"] for r in records]
    value_mean = [r["critic/value_mean"] for r in records]
    assert sum(reward[-3:]) / 3 > sum(reward[:3]) / 3 + 0.1, reward
    # the value head starts at zero (step 1: GAE is Monte-Carlo returns, nothing explained); the
    # critic then follows the rising returns. (Across steps its loss does not fall here: the returns
    # it chases grow with the reward; tests/trainer/test_critic.py shows the loss falling on fixed data.)
    assert value_mean[0] == 0.0 and records[0]["critic/explained_variance"] == 0.0
    assert sum(value_mean[-3:]) / 3 > 0.1, value_mean
    for step in (4, 8):
        assert os.path.isfile(tmp_path / "run" / "checkpoints" / f"step_{step:06d}" / "critic" / "model.safetensors")
