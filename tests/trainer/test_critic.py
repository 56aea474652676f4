"""The critic: values aligned with response tokens, trained alone, restored exactly from a checkpoint."""

from __future__ import annotations

import attrs
import pytest
import torch

from skyrl_core.algorithms.advantages import make_gae, make_grpo
from skyrl_core.config.loader import structure_config
from skyrl_core.config.schema import Config, ModelConfig
from skyrl_core.models import load_causal_lm
from skyrl_core.trainer import checkpoint as ckpt
from skyrl_core.trainer.critic import Critic, check_critic_choice
from skyrl_core.types import TrainingBatch
from tests.rollout.envs import TINY_QWEN3
from tests.trainer.test_checkpoint import FakeBackendState


def _cfg(advantage: str = "gae", **critic) -> Config:
    return structure_config({"model": {"config": TINY_QWEN3}, "trainer": {"micro_batch_size": 2, "seed": 3},
                             "algorithm": {"advantage": advantage,
                                           "critic": {"enabled": True, "lr": 1e-2, **critic}}})


def _batch() -> TrainingBatch:
    """Three rows: prompts left-padded to P=4 (lengths 4, 2, 3), responses right-padded to R=3."""
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(1, 500, (3, 7), generator=g)
    attention = torch.tensor([[1, 1, 1, 1, 1, 1, 1], [0, 0, 1, 1, 1, 1, 0], [0, 1, 1, 1, 1, 0, 0]])
    ids = ids * attention
    loss_mask = attention[:, 4:].float()
    return TrainingBatch(input_ids=ids, attention_mask=attention, loss_mask=loss_mask, group_ids=("a", "a", "b"))


def _train_batch(critic: Critic, batch: TrainingBatch) -> TrainingBatch:
    returns = torch.tensor([[1.0, 1.0, 1.0], [0.0, 0.5, 0.0], [2.0, 0.0, 0.0]]) * batch.loss_mask
    return attrs.evolve(batch, values=critic.values(batch), returns=returns)


def _bits(critic: Critic) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone().view(torch.int32) for k, v in critic.model.state_dict().items()}


def test_values_are_the_head_on_the_state_before_each_response_token() -> None:
    critic = Critic(_cfg(), ModelConfig(config=TINY_QWEN3))
    with torch.no_grad():  # a non-zero head, so that a misaligned position shows
        critic.model.head.weight.normal_(generator=torch.Generator().manual_seed(1))
    batch = _batch()
    values = critic.values(batch)
    assert values.shape == (3, 3) and not values.requires_grad
    assert torch.equal(values[batch.loss_mask == 0], torch.zeros(int((batch.loss_mask == 0).sum())))
    # row 1 alone, unpadded: prompt of 2 tokens, response of 2; value t from the hidden state at 2 - 1 + t
    ids = batch.input_ids[1:2, 2:6]
    with torch.no_grad():
        hidden = critic.model.body(input_ids=ids).last_hidden_state
        expected = critic.model.head(hidden[0, 1:3]).squeeze(-1)
        misaligned = critic.model.head(hidden[0, 2:4]).squeeze(-1)
    torch.testing.assert_close(values[1, :2], expected, atol=1e-5, rtol=1e-5)
    assert not torch.allclose(values[1, :2], misaligned, atol=1e-3)


def test_training_moves_only_the_critic_toward_the_returns() -> None:
    cfg = _cfg()
    policy = load_causal_lm(ModelConfig(config=TINY_QWEN3), seed=3)
    policy_before = {k: v.clone() for k, v in policy.state_dict().items()}
    critic = Critic(cfg, cfg.model)
    # a copy of the policy (same initial body weights), sharing no storage with it
    body = {k: v.clone() for k, v in critic.model.body.state_dict().items()}
    assert torch.equal(body["embed_tokens.weight"], policy.state_dict()["model.embed_tokens.weight"])
    assert not {p.data_ptr() for p in critic.model.parameters()} & {p.data_ptr() for p in policy.parameters()}
    critic.optimizer.param_groups[0]["lr"] = 3e-3
    losses = []
    for _ in range(4):  # as the trainer does: old values refreshed each step (value_clip bounds one step's move)
        batch = _train_batch(critic, _batch())
        losses += [critic.train_step(batch)["critic/value_loss"] for _ in range(2)]
    assert losses[-1] < 0.3 * losses[0]
    assert critic.optimizer_steps == 8
    # the body learned too (the head starts at zero, so only from the second step on)
    assert not torch.equal(critic.model.body.state_dict()["embed_tokens.weight"], body["embed_tokens.weight"])
    assert all(torch.equal(v, policy_before[k]) for k, v in policy.state_dict().items())
    assert all(p.grad is None for p in critic.model.parameters())  # zeroed after the step


def test_micro_batches_sum_to_the_whole_batch_loss() -> None:
    one = Critic(_cfg(), ModelConfig(config=TINY_QWEN3))
    two = Critic(_cfg(), ModelConfig(config=TINY_QWEN3))
    two.micro_batch_size = 3  # the whole batch in one pass (one: 2 rows, then 1)
    batch = _train_batch(one, _batch())
    a, b = one.train_step(batch), two.train_step(batch)
    assert a["critic/value_loss"] == pytest.approx(b["critic/value_loss"], rel=1e-6)
    assert a["critic/grad_norm"] == pytest.approx(b["critic/grad_norm"], rel=1e-5)


def test_checkpoint_restores_the_critic_bitwise(tmp_path) -> None:
    cfg = _cfg()
    batch = _batch()
    trained = Critic(cfg, cfg.model)
    data = _train_batch(trained, batch)
    for _ in range(2):
        trained.train_step(data)
    path = ckpt.save_checkpoint(str(tmp_path), 2, FakeBackendState(), {"history": []}, trained)

    resumed = Critic(cfg, cfg.model)
    fresh = _bits(resumed)
    assert any(not torch.equal(fresh[k], v) for k, v in _bits(trained).items())  # negative control
    ckpt.load_checkpoint(path, FakeBackendState(), resumed)
    assert all(torch.equal(_bits(resumed)[k], v) for k, v in _bits(trained).items())
    assert resumed.optimizer_steps == 2
    # the optimizer state too: one more step on both gives the same bits
    trained.train_step(data)
    resumed.train_step(data)
    assert all(torch.equal(_bits(resumed)[k], v) for k, v in _bits(trained).items())

    with pytest.raises(FileNotFoundError, match="holds no critic"):
        ckpt.load_checkpoint(ckpt.save_checkpoint(str(tmp_path), 3, FakeBackendState(), {"history": []}),
                             FakeBackendState(), resumed)


def test_estimator_and_critic_must_match(tmp_path) -> None:
    check_critic_choice(make_gae(), _cfg())
    with pytest.raises(ValueError, match="'gae' needs a critic: set algorithm.critic.enabled=true"):
        check_critic_choice(make_gae(), structure_config({"model": {"config": TINY_QWEN3},
                                                          "algorithm": {"advantage": "gae"}}))
    with pytest.raises(ValueError, match="algorithm.critic.enabled=true, but algorithm.advantage 'grpo' reads no"):
        check_critic_choice(make_grpo(), _cfg("grpo"))
    with pytest.raises(ValueError, match="algorithm.critic.path=.* is not a Hugging Face model directory"):
        check_critic_choice(make_gae(), _cfg(path=str(tmp_path)))


def test_resuming_a_checkpoint_without_a_critic_is_refused_before_work(tmp_path) -> None:
    without = ckpt.save_checkpoint(str(tmp_path), 1, FakeBackendState(), {"history": []})
    with pytest.raises(ValueError, match="trainer.resume: checkpoint .*step_000001' holds no critic"):
        check_critic_choice(make_gae(), _cfg(), resume_from=without)
    critic = Critic(_cfg(), ModelConfig(config=TINY_QWEN3))
    with_critic = ckpt.save_checkpoint(str(tmp_path), 2, FakeBackendState(), {"history": []}, critic)
    check_critic_choice(make_gae(), _cfg(), resume_from=with_critic)


def test_explained_variance_is_zero_for_returns_equal_but_for_rounding() -> None:
    from skyrl_core.trainer.critic import explained_variance

    mask = torch.ones(2, 3)
    values = torch.tensor([[0.3, 0.1, 0.2], [0.25, 0.15, 0.05]])
    # gae's returns are A + V in float32: equal returns come back with rounding residues
    returns = (torch.full((2, 3), 0.7) - values) + values
    assert returns.unique().numel() > 1  # the residue is there (else this test shows nothing)
    assert explained_variance(values, returns, mask) == 0.0
    # returns that truly differ: the usual 1 - Var(R - V) / Var(R)
    returns = torch.tensor([[1.0, 0.0, 1.0], [0.0, 0.0, 1.0]])
    expected = 1 - float((returns - values).var(unbiased=False)) / float(returns.var(unbiased=False))
    assert explained_variance(values, returns, mask) == pytest.approx(expected, abs=1e-6) and expected != 0.0
    assert explained_variance(returns, returns, mask) == 1.0
