"""End to end: SFT, then PPO with a critic and GAE on arithmetic with a tiny model: the reward
rises, the critic's value loss falls and its state is checkpointed."""

from __future__ import annotations

import os

import pytest
import yaml

from skyrl_core.config.loader import load_config
from skyrl_core.data import write_jsonl
from skyrl_core.trainer.metrics import read_metrics
from skyrl_core.trainer.rl import train
from tests.e2e.tiny_run import one_torch_thread, sft_tiny_arithmetic, tiny_arithmetic_rows


@pytest.mark.slow
def test_ppo_with_gae_after_sft_raises_reward_and_the_value_loss_falls(tmp_path, fresh_plugin_manager) -> None:
    # the policy (and the critic's body) start from a few SFT steps: answers are digits, mostly 0
    with one_torch_thread():
        policy = sft_tiny_arithmetic(tmp_path)
    write_jsonl(tiny_arithmetic_rows(), tmp_path / "train.jsonl")
    config = {
        "model": {"path": policy}, "environment": "arithmetic",
        "data": {"train": str(tmp_path / "train.jsonl"), "prompts_per_step": 8},
        "generation": {"max_new_tokens": 4, "n_samples": 8},
        "algorithm": {"policy_loss": "ppo", "advantage": "gae", "critic": {"enabled": True, "lr": 1e-3}},
        # the critic trains once per policy mini-batch and epoch: 8 updates a step, enough to follow
        # the returns (with one update a step it lagged the rising reward, and the loss rose with it)
        "trainer": {"steps": 10, "lr": 1e-2, "micro_batch_size": 32, "mini_batches": 4, "ppo_epochs": 2,
                    "checkpoint_every": 5, "progress": False, "plot": False, "output_dir": str(tmp_path / "run")},
    }
    (tmp_path / "ppo.yaml").write_text(yaml.safe_dump(config))
    cfg = load_config(str(tmp_path / "ppo.yaml"), plugin_manager=fresh_plugin_manager)
    with one_torch_thread():
        records = read_metrics(train(cfg, plugin_manager=fresh_plugin_manager).run_dir)
    assert [r["step"] for r in records] == list(range(1, 11))
    reward = [r["reward/mean"] for r in records]
    value_loss = [r["critic/value_loss"] for r in records]
    value_mean = [r["critic/value_mean"] for r in records]
    assert sum(reward[-3:]) / 3 > sum(reward[:3]) / 3 + 0.1, reward
    # Step 1 starts from the zero head (loss 0.5 * E[R^2]). By the end the critic has learned the
    # mean return: its loss is at most about the best constant prediction's, 0.5 * Var[R], well
    # below the start. Whether it also learns which problems the policy gets wrong within 10 steps
    # depends on the trajectory, which differs between CPUs (explained variance above 0.2 on
    # the AVX-512 machine this test was written on, 0.00 on an AVX2-only AMD EPYC, where the loss
    # ended at 1.02x the constant's): only
    # "no worse than a constant" is asserted for it.
    best_constant = 0.5 * records[-1]["reward/std"] ** 2
    assert max(value_loss[-3:]) < 0.5 * value_loss[0] and value_loss[-1] < 1.15 * best_constant, (value_loss, best_constant)
    assert abs(value_mean[-1] - reward[-1]) < 0.1, (value_mean, reward)
    assert records[-1]["critic/explained_variance"] > -0.05, [r["critic/explained_variance"] for r in records]
    for step in (5, 10):
        assert os.path.isfile(tmp_path / "run" / "checkpoints" / f"step_{step:06d}" / "critic" / "model.safetensors")
