"""Every policy loss against a loop reference (value and gradient), on a batch with padding, garbage
at untrained positions, extreme ratios and both advantage signs."""

from __future__ import annotations

import math

import attrs
import pytest
import torch

from skyrl_core.algorithms import options as O
from skyrl_core.algorithms import policy_losses as P
from skyrl_core.algorithms.precedence import effective_loss_reduction
from tests.algorithms.reference import (
    ADV,
    GROUPS,
    LOGP,
    MASK,
    OLD,
    ROLLOUT,
    clip,
    log_ratio,
    ref_weights,
    sigmoid,
    tensors,
    trained,
    weighted_sum,
)


def run(loss_fn, *, rollout=True, **kw):
    logp, old, adv, mask, ro = tensors()
    loss, metrics = loss_fn(logp, old, adv, mask, ro if rollout else None, group_ids=GROUPS, **kw)
    loss.backward()
    return loss, metrics, logp.grad


def check(loss_fn, rule, reduction="token_mean", rollout=True):
    """``rule(b, t) -> (per-token loss, d loss / d logp)``; compare value and every gradient entry."""
    loss, metrics, grad = run(loss_fn, rollout=rollout)
    w = ref_weights(MASK, reduction, GROUPS)
    per_token = [[0.0] * 4 for _ in range(4)]
    expected_grad = [[0.0] * 4 for _ in range(4)]
    for b, t in trained():
        per_token[b][t], g = rule(b, t)
        expected_grad[b][t] = g * w[b][t]
    assert loss.item() == pytest.approx(weighted_sum(per_token, w), rel=1e-12, abs=1e-12)
    assert torch.isfinite(grad).all()
    torch.testing.assert_close(grad, torch.tensor(expected_grad, dtype=torch.float64), rtol=1e-10, atol=1e-12)
    return metrics, grad


def ppo_rule(b, t, eps_low, eps_high):
    r, a = math.exp(log_ratio(b, t)), ADV[b][t]
    unclipped, clipped = -a * r, -a * clip(r, 1 - eps_low, 1 + eps_high)
    return max(unclipped, clipped), (0.0 if clipped > unclipped else -a * r)


def test_ppo_matches_reference_and_clipped_tokens_get_zero_gradient():
    metrics, grad = check(P.make_ppo(O.PPOOptions(eps_low=0.2, eps_high=0.28)), lambda b, t: ppo_rule(b, t, 0.2, 0.28))
    # (2,2): r = e^0.5 > 1.28 with A > 0; (1,1): r = e^-8 < 0.8 with A < 0 -> clipped, exactly zero
    assert grad[2, 2].item() == 0.0 and grad[1, 1].item() == 0.0
    # (1,0): r = e^8 with A < 0 is not clipped by PPO: large gradient
    assert grad[1, 0].item() > 100
    assert metrics["clip_frac"] == pytest.approx(2 / 10)
    assert metrics["ratio_max"] == pytest.approx(math.exp(8))


def test_ppo_defaults_are_symmetric_0_2():
    assert O.PPOOptions() == O.PPOOptions(eps_low=0.2, eps_high=0.2, loss_reduction=None)
    assert effective_loss_reduction(None, O.PPOOptions()) == "token_mean"


def test_dual_clip_bounds_negative_advantage_loss():
    c = 3.0

    def rule(b, t):
        loss, g = ppo_rule(b, t, 0.2, 0.2)
        a = ADV[b][t]
        if a < 0 and loss > -c * a:
            return -c * a, 0.0
        return loss, g

    metrics, grad = check(P.make_dual_clip(O.DualClipOptions(clip_ratio_c=c)), rule)
    # the e^8 ratio token with A = -1.5: loss capped at 4.5, gradient exactly zero
    assert grad[1, 0].item() == 0.0
    assert metrics["dual_clip_frac"] == pytest.approx(1 / 10)


def test_cispo_gradient_uses_the_clipped_weight_as_a_constant():
    eps_low, eps_high = 1.0, 0.28

    def rule(b, t):
        r, a = math.exp(log_ratio(b, t)), ADV[b][t]
        weight = clip(r, 1 - eps_low, 1 + eps_high)
        return -weight * a * LOGP[b][t], -weight * a

    metrics, grad = check(P.make_cispo(), rule)
    # clipped tokens still learn: (2,2) has r = e^0.5 > 1.28 and gets -1.28 * A * w, not 0
    w = ref_weights(MASK, "token_mean")
    assert grad[2, 2].item() == pytest.approx(-1.28 * 0.8 * w[2][2])
    # stop-gradient: without it (2,3) would get an extra -r * A * logp * w term
    r = math.exp(log_ratio(2, 3))
    assert grad[2, 3].item() == pytest.approx(-r * 0.8 * w[2][3])
    assert grad[2, 3].item() != pytest.approx(-r * 0.8 * w[2][3] * (1 + LOGP[2][3]))
    assert metrics["clip_frac"] == pytest.approx(2 / 10)  # (1,0) and (2,2)


def test_cispo_rollout_anchor_weights_by_pi_over_pi_rollout():
    eps_low, eps_high = 1.0, 0.28

    def rule(b, t):
        r, a = math.exp(log_ratio(b, t, ROLLOUT)), ADV[b][t]
        weight = clip(r, 1 - eps_low, 1 + eps_high)
        return -weight * a * LOGP[b][t], -weight * a

    check(P.make_cispo(O.CISPOOptions(anchor="rollout")), rule)
    with pytest.raises(ValueError, match="'cispo' needs rollout_logprobs"):
        run(P.make_cispo(O.CISPOOptions(anchor="rollout")), rollout=False)


def test_cispo_rollout_anchor_upstream_case():
    """Upstream SkyRL's test_policy_loss_cispo_rollout_anchor on this API (sum reduction)."""
    adv = torch.tensor([[1.0, -1.0, -4.0]])
    old = torch.tensor([[-1.0, -1.0, -3.0]])
    logp = torch.tensor([[-1.69315, -1.0, -0.69741]])
    rollout = torch.tensor([[-1.30685, -1.5, -1.0]])
    ones = torch.ones(1, 3)
    options = O.CISPOOptions(eps_low=0.2, eps_high=0.2, anchor="rollout")
    loss, _ = P.make_cispo(options)(logp, old, adv, ones, rollout, token_weights=ones)
    want = (-torch.exp(logp - rollout).clamp(0.8, 1.2) * adv * logp).sum()
    torch.testing.assert_close(loss, want)
    old_anchor, _ = P.make_cispo(attrs.evolve(options, anchor="old"))(logp, old, adv, ones, rollout, token_weights=ones)
    assert not torch.allclose(loss, old_anchor)


def test_sapo_soft_gate_value_and_gradient():
    tau_pos, tau_neg = 1.0, 1.05

    def rule(b, t):
        r, a = math.exp(log_ratio(b, t)), ADV[b][t]
        tau = tau_pos if a > 0 else tau_neg
        s = sigmoid(tau * (r - 1))
        return -(4 / tau) * s * a, -4 * s * (1 - s) * r * a

    check(P.make_sapo(), rule)


def test_sapo_gradient_equals_plain_policy_gradient_on_policy():
    """At r = 1 the gate's slope is exactly 1: SAPO is the unclipped policy gradient on-policy."""
    logp = torch.tensor([[-0.7, -1.2]], dtype=torch.float64, requires_grad=True)
    adv = torch.tensor([[1.0, -2.0]], dtype=torch.float64)
    loss, _ = P.make_sapo()(logp, logp.detach().clone(), adv, torch.ones(1, 2, dtype=torch.float64))
    loss.backward()
    torch.testing.assert_close(logp.grad, -adv / 2)


@pytest.mark.parametrize("rollout", [True, False], ids=["behaviour=rollout", "behaviour=old"])
@pytest.mark.parametrize("divergence", ["binary_tv", "binary_kl"])
def test_dppo_masks_by_binary_divergence(divergence, rollout):
    """The behaviour policy mu is the rollout policy (the paper, upstream SkyRL), else the old one."""
    delta, cap = 0.15, 20.0
    behaviour = ROLLOUT if rollout else OLD

    def rule(b, t):
        p, mu, a = math.exp(LOGP[b][t]), math.exp(behaviour[b][t]), ADV[b][t]
        if divergence == "binary_tv":
            d = abs(p - mu)
        else:
            d = mu * math.log(mu / p) + (1 - mu) * math.log((1 - mu) / (1 - p))
        blocked = (d > delta and p > mu) if a > 0 else (d > delta and p < mu)
        weight = 0.0 if blocked else min(math.exp(log_ratio(b, t, behaviour)), cap)
        return -weight * a * LOGP[b][t], -weight * a

    metrics, grad = check(P.make_dppo(O.DPPOOptions(divergence=divergence)), rule, rollout=rollout)
    # (1,1): probability fell from e^-0.4 (e^-0.5 old) to e^-8.5 with A < 0 -> outside the trust region
    assert grad[1, 1].item() == 0.0
    # (1,0): probability rose from e^-9.5 (e^-9 old) to e^-1: with A < 0 the update moves back, so it is kept
    assert grad[1, 0].item() != 0.0
    assert metrics["clip_frac"] > 0


def test_dppo_binary_kl_and_tv_disagree_where_they_should():
    """Token 0: probability 0.1 -> 0.001 with A < 0: TV 0.099 (kept) but binary KL 0.367 (masked).
    Token 1: probability 0.5 -> 0.7 with A > 0: TV 0.2 (masked) but binary KL 0.087 (kept)."""
    old = torch.tensor([[math.log(0.1), math.log(0.5)]], dtype=torch.float64)
    logp = torch.tensor([[math.log(0.001), math.log(0.7)]], dtype=torch.float64)
    adv, mask = torch.tensor([[-1.0, 1.0]], dtype=torch.float64), torch.ones(1, 2, dtype=torch.float64)
    grads = {}
    for divergence in ("binary_tv", "binary_kl"):
        x = logp.clone().requires_grad_(True)
        loss, _ = P.make_dppo(O.DPPOOptions(divergence=divergence))(x, old, adv, mask)
        loss.backward()
        grads[divergence] = x.grad[0].tolist()
    assert grads["binary_tv"][0] != 0.0 and grads["binary_tv"][1] == 0.0
    assert grads["binary_kl"][0] == 0.0 and grads["binary_kl"][1] != 0.0


@pytest.mark.parametrize("eps", [(0.2, 0.2), (0.5, 0.1)])
def test_rollout_is_is_token_masked_is_on_the_rollout_policy(eps):
    """Upstream SkyRL's rollout_is: ``-sg(r * 1[1 - eps_low < r < 1 + eps_high]) * A * log pi`` with
    ``r = pi / pi_rollout``; old logprobs play no part."""
    eps_low, eps_high = eps

    def rule(b, t):
        r, a = math.exp(log_ratio(b, t, ROLLOUT)), ADV[b][t]
        w = r if 1 - eps_low < r < 1 + eps_high else 0.0
        return -w * a * LOGP[b][t], -w * a

    metrics, grad = check(P.make_rollout_is(O.RolloutISOptions(eps_low=eps_low, eps_high=eps_high)), rule)
    # (0,2): pi / pi_rollout = e^0.95, outside either band: no gradient at all
    assert grad[0, 2].item() == 0.0
    # (2,0): r = e^0.2 = 1.22: in the band with eps_high 0.2? no (>= 1.2); with 0.1 neither
    assert grad[2, 0].item() == 0.0
    # (0,0): r = e^0.1 = 1.105: inside (0.8, 1.2), outside (0.5, 1.1)
    assert (grad[0, 0].item() != 0.0) == (eps_high == 0.2)
    assert 0 < metrics["clip_frac"] < 1


def test_rollout_is_needs_no_old_logprobs():
    logp, _, adv, mask, ro = tensors()
    with_old, _ = P.make_rollout_is()(logp, torch.zeros_like(ro), adv, mask, ro)
    without_old, _ = P.make_rollout_is()(logp, None, adv, mask, ro)
    assert with_old.item() == without_old.item()


def test_rollout_is_needs_rollout_logprobs():
    with pytest.raises(ValueError, match="rollout_is.*needs rollout_logprobs"):
        run(P.make_rollout_is(), rollout=False)


def test_importance_sampling_is_tinker_ratio_against_sampler():
    def rule(b, t):
        r = math.exp(log_ratio(b, t, ROLLOUT))
        return -r * ADV[b][t], -r * ADV[b][t]

    check(P.make_importance_sampling(), rule)

    def rule_old(b, t):  # without rollout logprobs the old policy is the sampler
        r = math.exp(log_ratio(b, t))
        return -r * ADV[b][t], -r * ADV[b][t]

    check(P.make_importance_sampling(), rule_old, rollout=False)


def test_dro_is_reinforce_with_a_quadratic_penalty_towards_the_sampler():
    beta = 0.3

    def rule(b, t, sampler=ROLLOUT):
        d = LOGP[b][t] - sampler[b][t]  # not clamped: (1,0) has d = 8.5 with the rollout
        return 0.5 * beta * d * d - LOGP[b][t] * ADV[b][t], beta * d - ADV[b][t]

    metrics, grad = check(P.make_dro(O.DROOptions(beta=beta)), rule)
    assert metrics["log_ratio_mean"] == pytest.approx(sum(LOGP[b][t] - ROLLOUT[b][t] for b, t in trained()) / 10)
    check(P.make_dro(O.DROOptions(beta=beta)), lambda b, t: rule(b, t, OLD), rollout=False)
    # beta 0 is plain REINFORCE on the advantages
    check(P.make_dro(O.DROOptions(beta=0.0)), lambda b, t: (-LOGP[b][t] * ADV[b][t], -ADV[b][t]))
    assert O.DROOptions().beta == 0.05
    for bad in (-0.1, float("inf"), float("nan"), True, "0.1"):
        with pytest.raises(ValueError, match="beta"):
            O.DROOptions(beta=bad)


def test_dro_needs_the_samplers_logprobs():
    logp, _, adv, mask, _ = tensors()
    with pytest.raises(ValueError, match="'dro' needs rollout_logprobs or old_logprobs"):
        P.make_dro()(logp, None, adv, mask)


def test_cross_entropy_is_token_nll_and_needs_no_advantages():
    check(P.make_cross_entropy(), lambda b, t: (-LOGP[b][t], -1.0))
    logp, _, _, mask, _ = tensors()
    loss, metrics = P.make_cross_entropy(O.CrossEntropyOptions(loss_reduction="sequence_mean"))(logp, None, None, mask)
    expected = sum(sum(-LOGP[b][t] for t in range(4) if MASK[b][t]) / sum(MASK[b]) for b in range(4)) / 4
    assert loss.item() == pytest.approx(expected)
    assert metrics["nll"] == pytest.approx(sum(-LOGP[b][t] for b, t in trained()) / 10)


def test_missing_advantages_is_a_clear_error():
    logp, old, _, mask, _ = tensors()
    with pytest.raises(ValueError, match="'ppo' needs advantages"):
        P.make_ppo()(logp, old, None, mask)


def test_shape_mismatch_names_the_tensors():
    logp, old, adv, mask, _ = tensors()
    with pytest.raises(ValueError, match=r"advantages has shape \(4, 3\) but logprobs has \(4, 4\)"):
        P.make_ppo()(logp, old, adv[:, :3], mask)


# --- GSPO ----------------------------------------------------------------------------------------


def test_gspo_matches_the_sequence_level_objective_and_its_gradient():
    """With one advantage per sequence and sequence-mean reduction, GSPO is
    ``mean_i max(-s_i A_i, -clip(s_i) A_i)`` with ``s_i = exp(mean_t log(pi/pi_old))``; check value and
    gradient against that objective written directly (autograd through ``s_i`` itself)."""
    eps = 0.2
    seq_adv = [1.0, -1.5, 0.8, -0.3]
    adv = torch.tensor([[a] * 4 for a in seq_adv], dtype=torch.float64)
    logp, old, _, mask, _ = tensors()
    loss, metrics = P.make_gspo(O.GSPOOptions(eps_low=eps, eps_high=eps))(logp, old, adv, mask)
    loss.backward()

    ref_logp = torch.tensor(LOGP, dtype=torch.float64, requires_grad=True)
    terms = []
    for b in range(4):
        ts = [t for t in range(4) if MASK[b][t]]
        s = torch.exp(sum(ref_logp[b, t] - OLD[b][t] for t in ts) / len(ts))
        a = seq_adv[b]
        terms.append(torch.maximum(-s * a, -s.clamp(1 - eps, 1 + eps) * a))
    ref_loss = sum(terms) / 4
    ref_loss.backward()
    assert loss.item() == pytest.approx(ref_loss.item(), rel=1e-12)
    grad = torch.nan_to_num(ref_logp.grad) * torch.tensor(MASK)
    torch.testing.assert_close(logp.grad, grad, rtol=1e-10, atol=1e-14)
    # every s_i is inside [0.8, 1.2] here (row 1: log-ratios +8 and -8 average to 0, s = 1);
    # the clipped case is the next test
    assert metrics["clip_frac"] == 0.0


def test_gspo_clipped_sequence_gets_zero_gradient_on_every_token():
    logp = torch.tensor([[-0.5, -0.5], [-1.0, -1.0]], dtype=torch.float64, requires_grad=True)
    old = torch.tensor([[-1.0, -1.0], [-1.0, -1.0]], dtype=torch.float64)  # row 0: s = e^0.5, row 1: s = 1
    adv = torch.ones(2, 2, dtype=torch.float64)
    loss, metrics = P.make_gspo()(logp, old, adv, torch.ones(2, 2, dtype=torch.float64))
    loss.backward()
    assert logp.grad[0].tolist() == [0.0, 0.0]
    # row 1 unclipped: d/dlogp_t of -s * A / 2 (sequence mean) = -(1 / 2) * s / L = -0.25
    torch.testing.assert_close(logp.grad[1], torch.tensor([-0.25, -0.25], dtype=torch.float64))
    assert metrics["clip_frac"] == 0.5


def test_gspo_default_clip_is_papers_3e4_4e4():
    assert (O.GSPOOptions().eps_low, O.GSPOOptions().eps_high) == (3e-4, 4e-4)
    assert O.GSPOOptions().loss_reduction is None and O.GSPOOptions.default_reduction == "sequence_mean"


# --- Clip-Cov / KL-Cov ---------------------------------------------------------------------------


def covariances():
    pts = trained()
    mean_lp = sum(LOGP[b][t] for b, t in pts) / len(pts)
    mean_a = sum(ADV[b][t] for b, t in pts) / len(pts)
    return {(b, t): (LOGP[b][t] - mean_lp) * (ADV[b][t] - mean_a) for b, t in pts}


def ppo_clipped(b, t, eps=0.2):
    r, a = math.exp(log_ratio(b, t)), ADV[b][t]
    return -a * clip(r, 1 - eps, 1 + eps) > -a * r


def test_clip_cov_keeps_ppo_clip_and_drops_unclipped_in_band_tokens():
    """Clip-Cov (reference and upstream SkyRL): PPO's clipped surrogate; the candidates are tokens PPO
    did not clip with covariance strictly inside the band."""
    cov = covariances()
    low, high = -0.05, 0.6  # holds (3,0), (2,3), (0,2) and (2,2), which PPO clips
    band = {k for k, c in cov.items() if low < c < high}
    dropped = {k for k in band if not ppo_clipped(*k)}
    assert 0 < len(dropped) < len(band) < 10  # a clipped token in the band must stay (and keep its value)

    def rule(b, t):
        return (0.0, 0.0) if (b, t) in dropped else ppo_rule(b, t, 0.2, 0.2)

    metrics, grad = check(P.make_clip_cov(O.ClipCovOptions(clip_ratio=1.0, cov_low=low, cov_high=high)), rule)
    assert all(grad[b, t].item() == 0.0 for b, t in dropped)
    assert metrics["cov_dropped_frac"] == pytest.approx(len(dropped) / 10)
    assert metrics["clip_frac"] == pytest.approx(2 / 10)


def test_clip_cov_drops_a_seeded_random_subset_of_the_band():
    torch.manual_seed(0)
    logp = torch.randn(2, 5, dtype=torch.float64) - 1
    adv = torch.randn(2, 5, dtype=torch.float64)
    mask = torch.ones(2, 5, dtype=torch.float64)
    options = O.ClipCovOptions(clip_ratio=0.3, cov_low=-100.0, cov_high=100.0, seed=7)  # every token in band
    grads = []
    for loss_fn in (P.make_clip_cov(options), P.make_clip_cov(options), P.make_clip_cov(attrs.evolve(options, seed=9))):
        x = logp.clone().requires_grad_(True)
        loss, metrics = loss_fn(x, logp, adv, mask)
        loss.backward()
        grads.append(x.grad)
        assert (x.grad == 0).sum().item() == 3  # int(0.3 * 10) tokens dropped, the others keep -A / 10
        kept = x.grad != 0
        torch.testing.assert_close(x.grad[kept], -adv[kept] / 10)
        assert metrics["cov_dropped_frac"] == pytest.approx(0.3)
    assert torch.equal(grads[0], grads[1])  # same seed, same choice
    assert not torch.equal(grads[0], grads[2])


def test_kl_cov_penalises_the_top_covariance_tokens():
    cov = covariances()
    coef, ratio = 0.5, 0.25
    top = set(sorted(cov, key=cov.get, reverse=True)[:2])  # max(1, int(0.25 * 10)) = 2

    def rule(b, t):
        r, a = math.exp(log_ratio(b, t)), ADV[b][t]
        loss, g = -r * a, -r * a
        if (b, t) in top:
            d = LOGP[b][t] - OLD[b][t]
            loss, g = loss + coef * abs(d), g + coef * ((d > 0) - (d < 0))  # d|x|/dx = sign(x), 0 at 0
        return loss, g

    metrics, _ = check(P.make_kl_cov(O.KLCovOptions(kl_ratio=ratio, kl_coef=coef)), rule)
    assert metrics["kl_penalised_frac"] == pytest.approx(0.2)


# --- properties shared by every loss ------------------------------------------------------------

ALL_LOSSES = [
    P.make_ppo,
    P.make_dual_clip,
    P.make_gspo,
    P.make_cispo,
    P.make_sapo,
    P.make_clip_cov,
    P.make_kl_cov,
    P.make_rollout_is,
    P.make_dppo,
    P.make_cross_entropy,
    P.make_importance_sampling,
    P.make_dro,
]


@pytest.mark.parametrize("make", ALL_LOSSES, ids=lambda m: m.__name__[5:])
def test_untrained_positions_get_no_gradient_and_no_nan(make):
    loss, metrics, grad = run(make())
    assert torch.isfinite(loss)
    assert all(math.isfinite(v) for v in metrics.values())
    untrained = torch.tensor(MASK) == 0
    assert torch.isfinite(grad).all()
    assert (grad[untrained] == 0).all()


@pytest.mark.parametrize("make", ALL_LOSSES, ids=lambda m: m.__name__[5:])
def test_extreme_log_ratio_stays_finite(make):
    """A log-ratio of +-60 (exp overflows float32) gives a finite loss and gradient."""
    logp = torch.tensor([[-0.1, -70.0], [-0.2, -0.3]], requires_grad=True)
    old = torch.tensor([[-60.1, -10.0], [-0.2, -0.3]])
    adv = torch.tensor([[-1.0, 1.0], [1.0, -1.0]])
    mask = torch.ones(2, 2)
    loss, metrics = make()(logp, old, adv, mask, old.clone())
    loss.backward()
    assert torch.isfinite(loss) and torch.isfinite(logp.grad).all()
    assert all(math.isfinite(v) for v in metrics.values())


def test_ppo_extreme_ratio_is_clamped_at_e20():
    logp = torch.tensor([[-0.1]], dtype=torch.float64, requires_grad=True)
    old = torch.tensor([[-60.1]], dtype=torch.float64)
    loss, _ = P.make_ppo()(logp, old, -torch.ones(1, 1, dtype=torch.float64), torch.ones(1, 1, dtype=torch.float64))
    assert loss.item() == pytest.approx(math.exp(20.0))


def test_bfloat16_inputs_are_computed_in_float32():
    logp = torch.tensor([[-0.5, -1.0]], dtype=torch.bfloat16, requires_grad=True)
    loss, _ = P.make_ppo()(logp, logp.detach().float(), torch.ones(1, 2), torch.ones(1, 2))
    assert loss.dtype == torch.float32
    loss.backward()
    assert logp.grad.dtype == torch.bfloat16
