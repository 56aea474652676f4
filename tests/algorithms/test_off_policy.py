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
    multiplier, metrics = correct(tis="token", tis_cap=1.1)
    want = expected(lambda b, s, row: min(math.exp(OLD[b][s] - ROLLOUT[b][s]), 1.1))
    torch.testing.assert_close(multiplier, want)
    assert metrics["mismatch/tis_capped_frac"] == pytest.approx(3 / 9)  # e^0.2 and e^0.1 (twice) > 1.1


def test_sequence_tis_uses_the_product_of_ratios():
    multiplier, _ = correct(tis="sequence", tis_cap=1.25)
    want = expected(lambda b, s, row: min(math.exp(sum(row)), 1.25))
    torch.testing.assert_close(multiplier, want)
    assert multiplier[1, 0].item() == pytest.approx(math.exp(0.2))  # e^(0.1 + 0.1) = 1.22 < 1.25
    capped, _ = correct(tis="sequence", tis_cap=1.2)
    assert capped[1, 0].item() == 1.2
    assert multiplier[0, 0].item() == pytest.approx(math.exp(-0.8))


@pytest.mark.parametrize("kind", ["geometric", "product"])
def test_sequence_masks(kind):
    low, high = 0.8, 1.15
    multiplier, metrics = correct(sequence_mask=kind, mask_low=low, mask_high=high)

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
    multiplier, _ = correct(tis="token", tis_cap=2.0, sequence_mask="geometric", mask_low=0.8, mask_high=1.2)
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
