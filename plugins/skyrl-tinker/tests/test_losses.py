"""Tinker's loss names on the core's losses: each one's sum matches Tinker's formula."""

import pytest
import torch

from skyrl_tinker.losses import LossInputError, check_loss, compute_loss

B, T = 2, 5


def _inputs(seed=0):
    g = torch.Generator().manual_seed(seed)
    logprobs = (-torch.rand(B, T, generator=g) * 3).requires_grad_(True)
    sampler = logprobs.detach() + 0.3 * torch.randn(B, T, generator=g)
    advantages = torch.randn(B, T, generator=g)
    weights = torch.rand(B, T, generator=g)
    mask = torch.ones(B, T)
    mask[1, 3:] = 0.0  # the second datum is 3 tokens long
    return logprobs, {"logprobs": sampler * mask, "advantages": advantages * mask, "weights": weights * mask}, mask


def test_cross_entropy_is_the_weighted_sum_of_negative_logprobs():
    lp, inputs, mask = _inputs()
    loss, _ = compute_loss("cross_entropy", None, lp, inputs, mask)
    assert torch.allclose(loss, (-lp * inputs["weights"] * mask).sum())
    loss.backward()
    assert torch.equal(lp.grad, -inputs["weights"] * mask)  # what the SDK's custom-loss path relies on


def test_importance_sampling_sums_ratio_times_advantage():
    lp, inputs, mask = _inputs(1)
    loss, _ = compute_loss("importance_sampling", None, lp, inputs, mask)
    ratio = torch.exp(lp - inputs["logprobs"])
    assert torch.allclose(loss, (-(ratio * inputs["advantages"]) * mask).sum())


@pytest.mark.parametrize("low, high", [(0.8, 1.2), (0.5, 1.5)])
def test_ppo_clips_the_ratio_at_the_given_thresholds(low, high):
    lp, inputs, mask = _inputs(2)
    config = {"clip_low_threshold": low, "clip_high_threshold": high}
    loss, _ = compute_loss("ppo", config, lp, inputs, mask)
    r, a = torch.exp(lp - inputs["logprobs"]), inputs["advantages"]
    expected = (torch.maximum(-r * a, -r.clamp(low, high) * a) * mask).sum()
    assert torch.allclose(loss, expected)


def test_cispo_weights_logprobs_by_the_clipped_ratio():
    lp, inputs, mask = _inputs(3)
    loss, _ = compute_loss("cispo", None, lp, inputs, mask)
    r = torch.exp(lp.detach() - inputs["logprobs"]).clamp(0.8, 1.2)
    assert torch.allclose(loss, (-r * inputs["advantages"] * lp * mask).sum())


def test_gspo_gives_each_sequence_its_sequence_objective():
    lp, inputs, mask = _inputs(4)
    loss, _ = compute_loss("gspo", {"clip_low_threshold": 0.5, "clip_high_threshold": 1.5}, lp, inputs, mask)
    lengths = mask.sum(-1, keepdim=True)
    s = torch.exp(((lp - inputs["logprobs"]) * mask).sum(-1, keepdim=True) / lengths)
    a = inputs["advantages"]
    per_token = torch.maximum(-s * a, -s.clamp(0.5, 1.5) * a)
    assert torch.allclose(loss, (per_token * mask / lengths).sum())


@pytest.mark.parametrize("config, beta", [(None, 0.05), ({"beta": 0.5}, 0.5), ({"beta": 0}, 0.0)])
def test_dro_is_tinkers_formula_with_beta_default_0_05(config, beta):
    lp, inputs, mask = _inputs(5)
    loss, metrics = compute_loss("dro", config, lp, inputs, mask)
    quadratic = (lp - inputs["logprobs"]) ** 2
    expected = -((lp * inputs["advantages"] - 0.5 * beta * quadratic) * mask).sum()
    assert torch.allclose(loss, expected)
    loss.backward()
    assert torch.allclose(lp.grad, (-inputs["advantages"] + beta * (lp.detach() - inputs["logprobs"])) * mask)
    assert "penalty_mean" in metrics


@pytest.mark.parametrize(
    "name, config, message",
    [
        ("stable_reinforce", None, "stability records"),
        ("dro", {"beta": -0.1}, "loss_fn_config.beta: must be >= 0"),
        ("dro", {"beta": float("inf")}, "finite"),
        ("dro", {"clip_low_threshold": 0.8}, "allowed: beta"),
        ("ppo", {"beta": 0.1}, "loss_fn_config.beta: not an option of 'ppo'"),
        ("custom", None, "client"),
        ("cross_entropi", None, "unknown; supported: cross_entropy"),
        ("ppo", {"clip_low": 0.8}, "loss_fn_config.clip_low: not an option of 'ppo'"),
        ("ppo", {"clip_high_threshold": 0.9}, "clip_high_threshold: must be > 1"),
        ("importance_sampling", {"clip_low_threshold": 0.8}, "allowed: none"),
        ("cispo", {"clip_low_threshold": float("nan")}, "finite"),
    ],
)
def test_bad_loss_names_and_configs_are_refused_by_name(name, config, message):
    with pytest.raises(LossInputError, match=message):
        check_loss(name, config)
