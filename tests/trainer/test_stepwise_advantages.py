"""Step-wise samples get their episode's advantage, estimated over episodes (not turns)."""

from __future__ import annotations

import torch

from skyrl_core.algorithms.advantages import make_grpo
from skyrl_core.rollout import TrainingSample, build_training_batch, token_rewards
from skyrl_core.trainer.rl import _advantages


def _step(trajectory: str, group: str, reward: float, last: bool, length: int) -> TrainingSample:
    return TrainingSample(prompt_ids=(1, 2), response_ids=(3,) * length, loss_mask=(1.0,) * length,
                          logprobs=(-1.0,) * length, reward=reward, group_id=group, trajectory_id=trajectory,
                          is_last_step=last)


def test_every_step_gets_its_episode_advantage() -> None:
    # group g: episode a (3 turns, reward 1) and episode b (1 turn, reward 0)
    samples = [_step("a", "g", 1.0, False, 2), _step("a", "g", 1.0, False, 4), _step("a", "g", 1.0, True, 3),
               _step("b", "g", 0.0, True, 5)]
    batch = build_training_batch(samples, pad_token_id=0)
    advantages, _ = _advantages(make_grpo(), samples, token_rewards(samples, batch.loss_mask), batch)
    # GRPO over the two episodes: (1 - 0.5) / std([1, 0]) and its negative, on every trained token
    episode_a, episode_b = advantages[2, 0].item(), advantages[3, 0].item()
    assert episode_a > 0 and abs(episode_a + episode_b) < 1e-6
    for row, s in enumerate(samples):
        expected = episode_a if s.trajectory_id == "a" else episode_b
        n = len(s.response_ids)
        assert torch.allclose(advantages[row, :n], torch.full((n,), expected))
        assert advantages[row, n:].abs().sum() == 0
    # negative control: estimating over all steps would count episode a three times
    per_step, _ = make_grpo()(token_rewards(samples, batch.loss_mask), batch.loss_mask, batch.group_ids)
    assert abs(per_step[2, 0].item() - episode_a) > 1e-3
