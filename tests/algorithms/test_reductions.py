"""Loss reductions as weights, and micro-batches summing exactly to the mini-batch loss."""

from __future__ import annotations

import pytest
import torch

from skyrl_core.algorithms import options as O
from skyrl_core.algorithms import policy_losses as P
from skyrl_core.algorithms.reductions import reduction_weights
from tests.algorithms.reference import GROUPS, MASK, ref_weights, tensors

REDUCTIONS = ["token_mean", "sequence_mean", "seq_mean_token_sum_norm", "prompt_mean"]


def test_weights_by_hand():
    mask = torch.tensor([[1, 1, 0], [1, 0, 0], [0, 0, 0]], dtype=torch.float64)
    groups = ["p", "q", "q"]
    # 3 trained tokens
    assert reduction_weights(mask, "token_mean").tolist() == [[1 / 3, 1 / 3, 0], [1 / 3, 0, 0], [0, 0, 0]]
    # two non-empty sequences: row 0 tokens 1/(2*2), row 1 token 1/(1*2); the empty row does not count
    assert reduction_weights(mask, "sequence_mean").tolist() == [[0.25, 0.25, 0], [0.5, 0, 0], [0, 0, 0]]
    # Dr. GRPO: 1 / (B * norm_len) with all 3 rows
    assert reduction_weights(mask, "seq_mean_token_sum_norm", norm_len=4).tolist() == [
        [1 / 12, 1 / 12, 0], [1 / 12, 0, 0], [0, 0, 0]]
    # norm_len defaults to the response length (3)
    assert reduction_weights(mask, "seq_mean_token_sum_norm")[0, 0].item() == pytest.approx(1 / 9)
    # group p has 2 tokens, group q has 1 token: mean over 2 groups
    assert reduction_weights(mask, "prompt_mean", groups).tolist() == [[0.25, 0.25, 0], [0.5, 0, 0], [0, 0, 0]]


@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_weights_match_counting_reference(reduction):
    got = reduction_weights(torch.tensor(MASK, dtype=torch.float64), reduction, GROUPS)
    torch.testing.assert_close(got, torch.tensor(ref_weights(MASK, reduction, GROUPS), dtype=torch.float64))
    assert got.sum().item() == pytest.approx(1.0 if reduction != "seq_mean_token_sum_norm" else 10 / 16)


def test_prompt_mean_weighs_groups_equally():
    """A group with many tokens and a group with one token contribute equally."""
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 1, 1], [1, 0, 0, 0]], dtype=torch.float64)
    w = reduction_weights(mask, "prompt_mean", ["big", "big", "small"])
    assert w[:2].sum().item() == pytest.approx(0.5) and w[2].sum().item() == pytest.approx(0.5)


def test_bool_mask_gives_float32_weights():
    w = reduction_weights(torch.tensor([[True, False]]), "token_mean")
    assert w.dtype == torch.float32 and w.tolist() == [[1.0, 0.0]]


def test_bad_reduction_and_missing_groups_are_clear_errors():
    mask = torch.ones(2, 2)
    with pytest.raises(ValueError, match="unknown loss reduction 'token_sum'; allowed: token_mean"):
        reduction_weights(mask, "token_sum")
    with pytest.raises(ValueError, match="group_ids is required"):
        reduction_weights(mask, "prompt_mean")
    with pytest.raises(ValueError, match="group_ids has 1 entries but the batch has 2"):
        reduction_weights(mask, "prompt_mean", ["a"])
    with pytest.raises(ValueError, match="norm_len must be a positive integer"):
        reduction_weights(mask, "seq_mean_token_sum_norm", norm_len=0)


def test_loss_uses_its_own_reduction_option():
    logp, old, adv, mask, _ = tensors()
    by_option, _ = P.make_ppo(O.PPOOptions(loss_reduction="sequence_mean"))(logp, old, adv, mask)
    by_weights, _ = P.make_ppo()(logp, old, adv, mask, token_weights=reduction_weights(mask, "sequence_mean"))
    token_mean, _ = P.make_ppo()(logp, old, adv, mask)
    assert by_option.item() == pytest.approx(by_weights.item(), rel=1e-14)
    assert by_option.item() != pytest.approx(token_mean.item())


# Clip-Cov and KL-Cov choose tokens from the statistics of the tokens they are given, so their
# micro-batch losses are not a split of the mini-batch loss (documented); every other loss is.
SPLITTABLE = [
    P.make_ppo,
    P.make_dual_clip,
    P.make_gspo,
    P.make_cispo,
    P.make_sapo,
    P.make_rollout_is,
    P.make_dppo,
    P.make_cross_entropy,
    P.make_importance_sampling,
]


@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("make", SPLITTABLE, ids=lambda m: m.__name__[5:])
def test_micro_batches_with_sliced_weights_sum_to_the_full_loss(make, reduction):
    logp, old, adv, mask, ro = tensors()
    weights = reduction_weights(mask, reduction, GROUPS)
    loss_fn = make()
    full, _ = loss_fn(logp, old, adv, mask, ro, token_weights=weights)
    full.backward()
    full_grad = logp.grad.clone()
    logp.grad = None

    total = torch.zeros((), dtype=torch.float64)
    for rows in (slice(0, 1), slice(1, 3), slice(3, 4)):
        part, _ = loss_fn(logp[rows], old[rows], adv[rows], mask[rows], ro[rows], token_weights=weights[rows],
                          group_ids=GROUPS[rows])
        part.backward()
        total = total + part.detach()
    assert total.item() == pytest.approx(full.item(), rel=1e-12, abs=1e-15)
    torch.testing.assert_close(logp.grad, full_grad, rtol=1e-12, atol=1e-15)

    # negative control: micro-batches that each reduce over their own tokens do not add up
    own_reduction = make(type(loss_fn.options)(loss_reduction=reduction))
    own = sum(own_reduction(logp[r], old[r], adv[r], mask[r], ro[r], group_ids=GROUPS[r])[0].item()
              for r in (slice(0, 1), slice(1, 3), slice(3, 4)))
    assert own != pytest.approx(full.item(), rel=1e-6)
