"""Off-policy correction (TIS, sequence masks, per-token masks) and mismatch metrics vs loops."""

from __future__ import annotations

import math

import pytest
import torch

from skyrl_core.algorithms.off_policy import off_policy_correction
from skyrl_core.config.schema import OffPolicyConfig

NAN = float("nan")
MASK = [[1, 1, 1, 0], [1, 1, 0, 0], [1, 1, 1, 1]]
OLD = [[-1.0, -0.5, -2.0, NAN], [-0.3, -0.2, 5.0, NAN], [-1.0, -1.0, -1.0, -1.0]]
ROLLOUT = [[-1.2, -0.5, -1.0, 0.0], [-0.4, -0.3, NAN, NAN], [-1.01, -0.99, -1.02, -0.98]]
# log rho = old - rollout: row 0 [0.2, 0, -1.0], row 1 [0.1, 0.1], row 2 [0.01, -0.01, 0.02, -0.02]


def t(x):
    return torch.tensor(x, dtype=torch.float64)


def log_rho():
    return [[OLD[b][s] - ROLLOUT[b][s] if MASK[b][s] else None for s in range(4)] for b in range(3)]


def correct(**cfg):
    return off_policy_correction(t(OLD), t(ROLLOUT), t(MASK), OffPolicyConfig(**cfg))


def expected(fn):
    """``fn(b, s, row_log_rhos) -> multiplier`` on trained tokens, 0 elsewhere."""
    lr = log_rho()
    out = []
    for b in range(3):
        row = [x for x in lr[b] if x is not None]
        out.append([fn(b, s, row) if MASK[b][s] else 0.0 for s in range(4)])
    return t(out)


def test_metrics_every_step_even_with_corrections_off():
    multiplier, metrics = correct()
    torch.testing.assert_close(multiplier, t(MASK))
    diffs = [abs(x) for row in log_rho() for x in row if x is not None]
    assert metrics["mismatch/abs_logprob_diff_mean"] == pytest.approx(sum(diffs) / len(diffs))
    assert metrics["mismatch/abs_logprob_diff_max"] == pytest.approx(1.0)
    k3 = [math.exp(x) - 1 - x for row in log_rho() for x in row if x is not None]
    assert metrics["mismatch/kl"] == pytest.approx(sum(k3) / len(k3))
    assert metrics["mismatch/masked_frac"] == 0.0


def test_token_tis_caps_each_token():
    multiplier, metrics = correct(tis="token", token_tis_cap=1.1)
    want = expected(lambda b, s, row: min(math.exp(OLD[b][s] - ROLLOUT[b][s]), 1.1))
    torch.testing.assert_close(multiplier, want)
    assert metrics["mismatch/tis_capped_frac"] == pytest.approx(3 / 9)  # e^0.2 and e^0.1 (twice) > 1.1


def test_sequence_tis_uses_the_product_of_ratios():
    multiplier, _ = correct(tis="sequence", sequence_tis_cap=1.25)
    want = expected(lambda b, s, row: min(math.exp(sum(row)), 1.25))
    torch.testing.assert_close(multiplier, want)
    assert multiplier[1, 0].item() == pytest.approx(math.exp(0.2))  # e^(0.1 + 0.1) = 1.22 < 1.25
    capped, _ = correct(tis="sequence", sequence_tis_cap=1.2)
    assert capped[1, 0].item() == 1.2
    assert multiplier[0, 0].item() == pytest.approx(math.exp(-0.8))


@pytest.mark.parametrize("kind", ["geometric", "product"])
def test_sequence_masks(kind):
    low, high = 0.8, 1.15
    prefix = "geo" if kind == "geometric" else "product"
    multiplier, metrics = correct(sequence_mask=kind, **{f"{prefix}_mask_low": low, f"{prefix}_mask_high": high})

    def keep(b, s, row):
        stat = math.exp(sum(row) / len(row)) if kind == "geometric" else math.exp(sum(row))
        return 1.0 if low <= stat <= high else 0.0

    torch.testing.assert_close(multiplier, expected(keep))
    # row 0: geometric e^(-0.8/3) = 0.77 (dropped), product e^-0.8 dropped; row 1: geometric e^0.1 kept,
    # product e^0.2 = 1.22 dropped; row 2 kept by both
    dropped_rows = [b for b in range(3) if multiplier[b].sum() == 0]
    assert dropped_rows == ([0] if kind == "geometric" else [0, 1])
    assert metrics["mismatch/masked_frac"] == pytest.approx((3 if kind == "geometric" else 5) / 9)


def test_per_token_outlier_mask_with_open_bound():
    multiplier, metrics = correct(token_mask_low=0.5, token_mask_high=1.05)
    want = expected(lambda b, s, row: 1.0 if 0.5 <= math.exp(OLD[b][s] - ROLLOUT[b][s]) <= 1.05 else 0.0)
    torch.testing.assert_close(multiplier, want)
    assert metrics["mismatch/masked_frac"] == pytest.approx(4 / 9)  # e^0.2, e^-1, e^0.1 (x2)
    only_high, _ = correct(token_mask_high=1.05)
    assert only_high[0, 2].item() == 1.0  # e^-1 kept without a lower bound


def test_tis_and_masks_compose():
    multiplier, _ = correct(tis="token", token_tis_cap=2.0, sequence_mask="geometric", geo_mask_low=0.8, geo_mask_high=1.2)
    torch.testing.assert_close(multiplier[0], torch.zeros(4, dtype=torch.float64))
    torch.testing.assert_close(multiplier[2], t([math.exp(x) for x in (0.01, -0.01, 0.02, -0.02)]))


def test_long_sequence_product_does_not_overflow():
    old = torch.full((1, 2000), -1.0, dtype=torch.float64)
    rollout = old - 0.5  # product ratio e^1000
    multiplier, metrics = off_policy_correction(old, rollout, torch.ones(1, 2000), OffPolicyConfig(sequence_mask="product"))
    assert multiplier.sum().item() == 0.0 and math.isfinite(metrics["mismatch/kl"])


def test_correction_without_rollout_logprobs():
    multiplier, metrics = off_policy_correction(t(OLD), None, t(MASK), OffPolicyConfig())
    torch.testing.assert_close(multiplier, t(MASK))
    assert metrics == {}
    with pytest.raises(ValueError, match="no rollout_logprobs"):
        off_policy_correction(t(OLD), None, t(MASK), OffPolicyConfig(tis="token"))


def test_token_and_sequence_tis_have_separate_caps():
    # defaults as upstream SkyRL: 2.0 for a token ratio, 5.0 for a sequence product
    assert (OffPolicyConfig().token_tis_cap, OffPolicyConfig().sequence_tis_cap) == (2.0, 5.0)
    token, _ = correct(tis="token", token_tis_cap=1.1, sequence_tis_cap=9.0)
    sequence, _ = correct(tis="sequence", token_tis_cap=9.0, sequence_tis_cap=1.2)
    assert token[0, 0].item() == 1.1  # e^0.2 capped by the token cap
    assert sequence[1, 0].item() == 1.2  # e^0.2 (product of row 1) capped by the sequence cap


def test_geometric_and_product_masks_have_separate_bounds():
    assert (OffPolicyConfig().geo_mask_low, OffPolicyConfig().geo_mask_high) == (0.99, 1.01)
    assert (OffPolicyConfig().product_mask_low, OffPolicyConfig().product_mask_high) == (0.5, 2.0)
    # row 1: geometric mean e^0.1 = 1.105, product e^0.2 = 1.221; the other kind's bounds must not apply
    geo, _ = correct(sequence_mask="geometric", geo_mask_low=0.5, geo_mask_high=1.11, product_mask_high=1.0)
    product, _ = correct(sequence_mask="product", product_mask_low=0.5, product_mask_high=1.2, geo_mask_high=5.0)
    assert geo[1].sum().item() == 2.0 and product[1].sum().item() == 0.0


def test_outlier_mask_drops_the_whole_sample():
    # row 0 has rho = e^-1 = 0.37 on one token: with low 0.5 the whole row goes, nothing else does
    multiplier, metrics = correct(outlier_token_low=0.5)
    torch.testing.assert_close(multiplier, expected(lambda b, s, row: 0.0 if b == 0 else 1.0))
    assert metrics["mismatch/outlier_sample_frac"] == pytest.approx(1 / 3)
    # high 1.15: rows 0 (e^0.2) dropped, row 1 (e^0.1) kept; the token mask would keep the other tokens
    high_only, _ = correct(outlier_token_high=1.15)
    assert [high_only[b].sum().item() for b in range(3)] == [0.0, 2.0, 4.0]
    token_masked, _ = correct(token_mask_high=1.15)
    assert token_masked[0].sum().item() == 2.0


def test_sequence_tis_and_sequence_mask_use_the_tokens_masks_kept():
    # upstream order: outlier/token masks first, then TIS and the sequence mask over the kept tokens;
    # token mask high 1.15 drops row 0's e^0.2 token, leaving log rho [0, -1.0] -> product e^-1
    multiplier, _ = correct(token_mask_high=1.15, tis="sequence", sequence_tis_cap=5.0)
    assert multiplier[0].tolist() == pytest.approx([0.0, math.exp(-1.0), math.exp(-1.0), 0.0])


def test_upstream_sequence_tis_cap_case():
    """Upstream SkyRL's test_compute_tis_ratio_sequence_level_with_cap on this API: log ratios sum
    to 3.0 (e^3 = 20.1 > the default sequence cap 5.0) -> every token gets 5.0."""
    old = t([[-1.0, -1.0, -1.0]])
    rollout = t([[-2.0, -2.0, -2.0]])
    multiplier, metrics = off_policy_correction(old, rollout, t([[1, 1, 1]]), OffPolicyConfig(tis="sequence"))
    assert multiplier.tolist() == [[5.0, 5.0, 5.0]]
    assert metrics["mismatch/tis_capped_frac"] == 1.0


def test_bounds_must_be_ordered():
    with pytest.raises(ValueError, match="must be >= geo_mask_low"):
        OffPolicyConfig(geo_mask_low=1.2, geo_mask_high=1.1)
    with pytest.raises(ValueError, match="must be >= outlier_token_low"):
        OffPolicyConfig(outlier_token_low=2.0, outlier_token_high=1.0)
