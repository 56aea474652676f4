"""Advantage estimators against loop references: groups of one, all-equal rewards, masked tokens."""

from __future__ import annotations

import math
import statistics

import pytest
import torch

from skyrl_core.algorithms import advantages as A
from skyrl_core.algorithms import options as O
from skyrl_core.algorithms.tensor_utils import masked_mean

# 6 samples, 4 response tokens; outcome reward on each sample's last trained token.
MASK = [
    [1, 1, 1, 0],
    [1, 1, 0, 0],
    [1, 1, 1, 1],
    [1, 0, 0, 0],
    [1, 1, 1, 1],
    [1, 1, 1, 0],
]
SCORES = [1.0, 0.0, 1.0, 0.5, 0.0, 2.0]
# g0: three samples; "solo": a group of one; "same": two samples (equal rewards in some tests)
GROUPS = ["g0", "g0", "g0", "solo", "same", "same"]


def outcome_batch(scores=SCORES, mask=MASK, garbage=True):
    rewards = [[(float("nan") if garbage else 0.0)] * 4 for _ in scores]
    for b, s in enumerate(scores):
        last = max(t for t in range(4) if mask[b][t])
        for t in range(4):
            if mask[b][t]:
                rewards[b][t] = s if t == last else 0.0
    return torch.tensor(rewards, dtype=torch.float64), torch.tensor(mask, dtype=torch.float64)


def per_token(per_sample, mask=MASK):
    return torch.tensor([[per_sample[b] if mask[b][t] else 0.0 for t in range(4)] for b in range(len(mask))],
                        dtype=torch.float64)


def groups_of(groups):
    out: dict = {}
    for b, g in enumerate(groups):
        out.setdefault(g, []).append(b)
    return out


def ref_grpo(scores, groups, norm_by_std=True, eps=1e-6):
    adv = [0.0] * len(scores)
    for members in groups_of(groups).values():
        values = [scores[b] for b in members]
        mean = sum(values) / len(values)
        std = statistics.stdev(values) if len(values) > 1 else 0.0
        for b in members:
            adv[b] = (scores[b] - mean) / (std + eps) if norm_by_std else scores[b] - mean
    return adv


def test_grpo_matches_reference_with_solo_and_equal_groups():
    scores = [1.0, 0.0, 1.0, 0.5, 0.7, 0.7]
    rewards, mask = outcome_batch(scores)
    adv, returns = A.make_grpo()(rewards, mask, GROUPS)
    torch.testing.assert_close(adv, per_token(ref_grpo(scores, GROUPS)))
    # g0: mean 2/3, std (unbiased) 0.57735: (1 - 2/3) / 0.57735 = 0.57735
    assert adv[0, 0].item() == pytest.approx((1 / 3) / math.sqrt(1 / 3), rel=1e-5)
    # a group of one and an all-equal group carry no signal: exactly 0
    assert adv[3].abs().sum().item() == 0.0 and adv[4:].abs().sum().item() == 0.0
    # returns: undiscounted reward-to-go = the score on every trained token
    torch.testing.assert_close(returns, per_token(scores))


def test_dr_grpo_does_not_divide_by_std():
    rewards, mask = outcome_batch()
    adv, _ = A.make_grpo(O.GRPOOptions(norm_by_std=False))(rewards, mask, GROUPS)
    torch.testing.assert_close(adv, per_token(ref_grpo(SCORES, GROUPS, norm_by_std=False)))
    assert adv[0, 0].item() == pytest.approx(1 - 2 / 3)
    assert adv[4, 0].item() == pytest.approx(0.0 - 1.0) and adv[5, 0].item() == pytest.approx(2.0 - 1.0)


def test_grpo_with_batch_whitening():
    rewards, mask = outcome_batch()
    adv, _ = A.make_grpo(O.GRPOOptions(whiten=True))(rewards, mask, GROUPS)
    raw = per_token(ref_grpo(SCORES, GROUPS))
    values = [raw[b, t].item() for b in range(6) for t in range(4) if MASK[b][t]]
    mean, std = statistics.mean(values), statistics.stdev(values)
    expected = [[(raw[b, t].item() - mean) / (std + 1e-8) if MASK[b][t] else 0.0 for t in range(4)] for b in range(6)]
    torch.testing.assert_close(adv, torch.tensor(expected, dtype=torch.float64))


def test_rloo_leave_one_out_baseline():
    rewards, mask = outcome_batch()
    adv, _ = A.make_rloo()(rewards, mask, GROUPS)
    expected = []
    for b, g in enumerate(GROUPS):
        others = [SCORES[j] for j, h in enumerate(GROUPS) if h == g and j != b]
        expected.append(SCORES[b] - sum(others) / len(others) if others else 0.0)
    torch.testing.assert_close(adv, per_token(expected))
    assert adv[0, 0].item() == pytest.approx(1 - 0.5)  # 1 - mean(0, 1)
    assert adv[3].abs().sum().item() == 0.0  # solo


def test_maxrl_normalises_by_the_group_mean():
    """Binary rewards: (r - p) / p with p the group's success rate; a group with no success gets 0."""
    scores = [1.0, 0.0, 0.0, 0.0, 1.0, 1.0]
    groups = ["a", "a", "a", "none", "all", "all"]
    rewards, mask = outcome_batch(scores)
    adv, _ = A.make_maxrl()(rewards, mask, groups)
    # group a: p = 1/3 -> success (1 - 1/3) / (1/3) = 2, failure -1
    expected = [2.0, -1.0, -1.0, 0.0, 0.0, 0.0]
    torch.testing.assert_close(adv, per_token(expected))
    # equals (1/K) on successes minus (1/N) on all, times N: the MaxRL estimator
    n, k = 3, 1
    assert adv[0, 0].item() == pytest.approx(n * (1 / k - 1 / n))


def test_maxrl_rejects_negative_rewards():
    rewards, mask = outcome_batch([1.0, -1.0, 0.0, 0.0, 0.0, 0.0], garbage=False)
    with pytest.raises(ValueError, match="maxrl needs non-negative rewards"):
        A.make_maxrl()(rewards, mask, GROUPS)


def ref_returns(rewards, mask, gamma):
    out = [[0.0] * 4 for _ in rewards]
    for b in range(len(rewards)):
        running = 0.0
        for t in reversed(range(4)):
            if mask[b][t]:
                running = rewards[b][t] + gamma * running
                out[b][t] = running
    return out


def test_reinforce_plus_plus_whitens_discounted_returns_over_the_batch():
    token_rewards = [[0.1, -0.2, 1.0, 9.0], [0.0, 0.5, 7.0, 7.0], [0.3, 0.0, 0.0, 1.0]]
    mask = [[1, 1, 1, 0], [1, 1, 0, 0], [1, 0, 1, 1]]  # row 2 has an untrained token inside
    gamma = 0.9
    adv, returns = A.make_reinforce_plus_plus(O.ReinforcePlusPlusOptions(gamma=gamma))(
        torch.tensor(token_rewards, dtype=torch.float64), torch.tensor(mask, dtype=torch.float64), [0, 1, 2])
    ref = ref_returns(token_rewards, mask, gamma)
    torch.testing.assert_close(returns, torch.tensor(ref, dtype=torch.float64))
    # the untrained token is skipped: G(2,0) = 0.3 + 0.9 * G(2,2), not + 0.81 * G(2,2)
    assert returns[2, 0].item() == pytest.approx(0.3 + 0.9 * (0.0 + 0.9 * 1.0))
    values = [ref[b][t] for b in range(3) for t in range(4) if mask[b][t]]
    mean, std = statistics.mean(values), statistics.stdev(values)
    expected = [[(ref[b][t] - mean) / (std + 1e-8) if mask[b][t] else 0.0 for t in range(4)] for b in range(3)]
    torch.testing.assert_close(adv, torch.tensor(expected, dtype=torch.float64))


def ref_gae(rewards, values, mask, gamma, lam):
    adv = [[0.0] * 4 for _ in rewards]
    for b in range(len(rewards)):
        ts = [t for t in range(4) if mask[b][t]]
        last = 0.0
        for i in reversed(range(len(ts))):
            t = ts[i]
            next_value = values[b][ts[i + 1]] if i + 1 < len(ts) else 0.0
            delta = rewards[b][t] + gamma * next_value - values[b][t]
            last = delta + gamma * lam * last
            adv[b][t] = last
    return adv


def test_gae_matches_recursion_and_skips_untrained_tokens():
    rewards = [[0.0, 0.0, 1.0, 5.0], [0.0, 0.2, 0.0, 0.0], [0.1, 9.0, 0.0, 1.0]]
    values = [[0.5, 0.4, 0.7, 3.0], [0.1, -0.2, 4.0, 4.0], [0.3, 8.0, 0.2, 0.9]]
    mask = [[1, 1, 1, 0], [1, 1, 0, 0], [1, 0, 1, 1]]
    gamma, lam = 0.95, 0.9
    est = A.make_gae(O.GAEOptions(gamma=gamma, lam=lam, whiten=False))
    t = lambda x: torch.tensor(x, dtype=torch.float64)  # noqa: E731
    adv, returns = est(t(rewards), t(mask), [0, 1, 2], values=t(values))
    ref = ref_gae(rewards, values, mask, gamma, lam)
    torch.testing.assert_close(adv, t(ref))
    expected_returns = [[ref[b][s] + values[b][s] if mask[b][s] else 0.0 for s in range(4)] for b in range(3)]
    torch.testing.assert_close(returns, t(expected_returns))
    # hand check of the last token of row 0: delta = 1.0 + 0 - 0.7
    assert adv[0, 2].item() == pytest.approx(0.3)
    # gamma = lam = 1: advantage = reward-to-go - value
    adv1, _ = A.make_gae(O.GAEOptions(whiten=False))(t(rewards), t(mask), [0, 1, 2], values=t(values))
    rtg = ref_returns(rewards, mask, 1.0)
    torch.testing.assert_close(adv1, t([[rtg[b][s] - values[b][s] if mask[b][s] else 0.0 for s in range(4)]
                                         for b in range(3)]))


def test_gae_whitens_by_default_and_needs_values():
    rewards, mask = outcome_batch()
    values = torch.rand(6, 4, dtype=torch.float64)
    adv, _ = A.make_gae()(rewards, mask, GROUPS, values=values)
    assert masked_mean(adv, mask).item() == pytest.approx(0.0, abs=1e-12)
    with pytest.raises(ValueError, match="'gae' needs values"):
        A.make_gae()(rewards, mask, GROUPS)


@pytest.mark.parametrize("make", [A.make_grpo, A.make_rloo, A.make_maxrl, A.make_reinforce_plus_plus])
def test_untrained_positions_are_zero_and_finite(make):
    rewards, mask = outcome_batch()  # nan at untrained positions
    adv, returns = make()(rewards, mask, GROUPS)
    assert torch.isfinite(adv).all() and torch.isfinite(returns).all()
    untrained = mask == 0
    assert (adv[untrained] == 0).all() and (returns[untrained] == 0).all()


def test_estimator_input_errors():
    rewards, mask = outcome_batch()
    with pytest.raises(ValueError, match="group_ids has 5 entries but the batch has 6"):
        A.make_grpo()(rewards, mask, GROUPS[:5])
    with pytest.raises(ValueError, match="response_mask has shape"):
        A.make_grpo()(rewards, mask[:, :2], GROUPS)


def test_zero_variance_group_mask():
    keep = A.zero_variance_group_mask([1.0, 0.0, 1.0, 0.5, 0.7, 0.7, 1.0, 1.0, 1.0], GROUPS + ["x", "x", "x"])
    assert keep.tolist() == [True, True, True, False, False, False, False, False, False]
    assert keep.dtype == torch.bool
    with pytest.raises(ValueError, match=r"one scalar per sample"):
        A.zero_variance_group_mask(torch.zeros(2, 2), [0, 1])


def test_sequence_rewards_sums_trained_tokens():
    rewards, mask = outcome_batch()
    assert A.sequence_rewards(rewards, mask).tolist() == SCORES
