"""KL estimators, KL loss and penalty, KL controllers, entropy, and the critic's value loss."""

from __future__ import annotations

import math

import pytest
import torch

from skyrl_core.algorithms.critic import value_loss
from skyrl_core.algorithms.entropy import entropy_bonus, entropy_from_logits
from skyrl_core.algorithms.kl import (
    AdaptiveKLController,
    FixedKLController,
    apply_kl_penalty,
    kl_estimate,
    kl_loss,
)

LOGP = [[-1.0, -0.2, -3.0], [-0.5, -2.5, 0.0]]
REF = [[-1.3, -0.2, -1.0], [-0.1, -2.0, 7.0]]
MASK = [[1, 1, 1], [1, 1, 0]]


def t(x):
    return torch.tensor(x, dtype=torch.float64)


def ref_kl(lp, ref, kind):
    log_r = ref - lp
    return {"k1": -log_r, "k2": 0.5 * log_r**2, "k3": math.exp(log_r) - 1 - log_r, "abs": abs(log_r)}[kind]


@pytest.mark.parametrize("kind", ["k1", "k2", "k3", "abs"])
def test_kl_estimators_elementwise(kind):
    got = kl_estimate(t(LOGP), t(REF), kind)
    expected = [[ref_kl(LOGP[b][s], REF[b][s], kind) for s in range(3)] for b in range(2)]
    torch.testing.assert_close(got, t(expected))


def test_k3_is_non_negative_and_unbiased_for_the_true_kl():
    """E_{y~pi}[k3] = KL(pi || ref) exactly when the expectation is taken over the full support."""
    pi = torch.tensor([0.5, 0.3, 0.2], dtype=torch.float64)
    ref = torch.tensor([0.2, 0.5, 0.3], dtype=torch.float64)
    true_kl = (pi * (pi / ref).log()).sum()
    for kind in ("k1", "k3"):
        expectation = (pi * kl_estimate(pi.log(), ref.log(), kind)).sum()
        assert expectation.item() == pytest.approx(true_kl.item(), rel=1e-12)
    assert (kl_estimate(pi.log(), ref.log(), "k3") >= 0).all()
    assert (kl_estimate(pi.log(), ref.log(), "k1") < 0).any()  # k1 is unbiased but can go negative


def test_unknown_kl_estimator():
    with pytest.raises(ValueError, match="unknown KL estimator 'k4'; allowed: k1, k2, k3, abs"):
        kl_estimate(t(LOGP), t(REF), "k4")


def test_kl_loss_token_mean_and_gradient():
    lp = t(LOGP).requires_grad_(True)
    loss, metrics = kl_loss(lp, t(REF), t(MASK), "k3")
    pts = [(b, s) for b in range(2) for s in range(3) if MASK[b][s]]
    expected = sum(ref_kl(LOGP[b][s], REF[b][s], "k3") for b, s in pts) / len(pts)
    assert loss.item() == pytest.approx(expected)
    assert metrics["kl"] == pytest.approx(expected)
    loss.backward()
    # d k3 / d logp = 1 - exp(ref - logp)
    grad = [[(1 - math.exp(REF[b][s] - LOGP[b][s])) / 5 if MASK[b][s] else 0.0 for s in range(3)] for b in range(2)]
    torch.testing.assert_close(lp.grad, t(grad))


def test_kl_penalty_on_rewards():
    rewards = t([[0.0, 0.0, 1.0], [0.0, 2.0, 9.0]])
    kl = kl_estimate(t(LOGP), t(REF), "k1")
    got = apply_kl_penalty(rewards, kl, 0.1, t(MASK))
    expected = [[rewards[b, s].item() - 0.1 * kl[b, s].item() if MASK[b][s] else 0.0 for s in range(3)] for b in range(2)]
    torch.testing.assert_close(got, t(expected))


def test_fixed_and_adaptive_kl_controllers():
    fixed = FixedKLController(0.05)
    assert fixed.update(100.0, 64) == 0.05 and fixed.value == 0.05
    ctl = AdaptiveKLController(init=0.1, target=6.0, horizon=10000)
    # KL 9 > target: error clipped to +0.2; value *= 1 + 0.2 * 256 / 10000
    assert ctl.update(9.0, 256) == pytest.approx(0.1 * 1.00512)
    # KL 5.4: error -0.1, not clipped
    assert ctl.update(5.4, 1000) == pytest.approx(0.1 * 1.00512 * 0.99)
    # KL 0: error clipped to -0.2
    assert ctl.update(0.0, 10000) == pytest.approx(0.1 * 1.00512 * 0.99 * 0.8)
    with pytest.raises(ValueError, match="target KL must be > 0"):
        AdaptiveKLController(0.1, 0.0, 10)


def test_entropy_from_logits():
    logits = t([[[2.0, 0.5, -1.0, 0.0], [0.0, 0.0, 0.0, 0.0]], [[100.0, 0.0, -5.0, 3.0], [1.0, 2.0, 3.0, 4.0]]])
    expected = []
    for row in logits.tolist():
        out = []
        for z in row:
            m = max(z)
            exps = [math.exp(v - m) for v in z]
            total = sum(exps)
            out.append(-sum(e / total * math.log(e / total) for e in exps))
        expected.append(out)
    got = entropy_from_logits(logits)
    torch.testing.assert_close(got, t(expected))
    assert got[0, 1].item() == pytest.approx(math.log(4))


def test_entropy_bonus_rewards_entropy():
    entropy = t([[1.0, 2.0, 9.0], [0.5, 0.5, 9.0]])
    loss, metrics = entropy_bonus(entropy, t(MASK), coef=0.01)
    assert loss.item() == pytest.approx(-0.01 * (1.0 + 2.0 + 9.0 + 0.5 + 0.5) / 5)
    assert metrics["entropy"] == pytest.approx(13.0 / 5)


def test_value_loss_clipping():
    values = t([[1.0, 0.5, 2.0], [1.0, -1.0, 5.0]]).requires_grad_(True)
    old = t([[0.5, 0.5, 1.0], [0.3, -0.9, 0.0]])
    returns = t([[1.5, 0.0, 0.0], [1.0, -1.0, 0.0]])
    clip = 0.2
    loss, metrics = value_loss(values, old, returns, t(MASK), clip)
    loss.backward()
    per, grads, clipped = 0.0, [[0.0] * 3 for _ in range(2)], 0
    for b in range(2):
        for s in range(3):
            if not MASK[b][s]:
                continue
            v, o, r = values[b, s].item(), old[b][s].item(), returns[b][s].item()
            vc = o + min(max(v - o, -clip), clip)
            u, c = (v - r) ** 2, (vc - r) ** 2
            per += 0.5 * max(u, c)
            if c > u:
                clipped += 1  # gradient 0: the clipped value is a constant
            else:
                grads[b][s] = (v - r) / 5
    assert loss.item() == pytest.approx(per / 5)
    torch.testing.assert_close(values.grad, t(grads))
    assert clipped == 2 and metrics["vf_clip_frac"] == pytest.approx(2 / 5)
    # (0,0) and (1,0) moved past the clip towards their return: the clipped error is larger, no gradient
    assert values.grad[0, 0].item() == 0.0 and values.grad[1, 0].item() == 0.0
    # (0,2) moved away from its return: the unclipped error is larger and keeps its gradient
    assert values.grad[0, 2].item() == pytest.approx(2.0 / 5)

    unclipped, _ = value_loss(values, old, returns, t(MASK), None)
    assert unclipped.item() < loss.item()
