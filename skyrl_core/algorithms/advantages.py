"""The built-in advantage estimators, and zero-variance group filtering (dynamic sampling).

Each ``make_<name>(options)`` returns an ``AdvantageEstimatorFn``: a callable

    estimator(token_rewards, response_mask, group_ids, values=None) -> (advantages, returns)

``token_rewards`` and ``response_mask`` are ``[B, R]`` (an outcome reward sits on the last response
token; a KL reward penalty, if any, is spread over the tokens); ``group_ids`` has one id per sample,
samples of one prompt sharing an id. Both outputs are ``[B, R]`` and 0 where the mask is 0.

Untrained positions inside a response (e.g. tokens written by an environment between turns) are
transparent: returns and GAE skip over them as if they were not there. The outcome estimators
(grpo, rloo, maxrl) score a sample by the sum of its masked token rewards and give every trained
token that sample's advantage; their ``returns`` are the undiscounted rewards-to-go.
Formulas and references: docs/algorithms.md.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import torch

from skyrl_core.algorithms import options as opts
from skyrl_core.algorithms.tensor_utils import (
    as_float,
    check_shapes,
    group_index,
    masked_sum,
    masked_whiten,
    zero_where_masked,
)


class AdvantageEstimatorFn:
    """A built advantage estimator: ``name``, its ``options`` and its rule."""

    def __init__(self, name: str, options: Any, rule: Callable[..., tuple[torch.Tensor, torch.Tensor]], *, needs_values: bool = False) -> None:
        self.name = name
        self.options = options
        self._rule = rule
        self._needs_values = needs_values

    def __repr__(self) -> str:
        return f"AdvantageEstimatorFn({self.name!r}, {self.options!r})"

    def __call__(
        self,
        token_rewards: torch.Tensor,
        response_mask: torch.Tensor,
        group_ids: Sequence[Any],
        values: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if self._needs_values and values is None:
            raise ValueError(f"advantage estimator {self.name!r} needs values (a critic), got None")
        check_shapes("token_rewards", token_rewards, response_mask=response_mask, values=values)
        rewards = zero_where_masked(as_float(token_rewards).detach(), response_mask)
        if values is not None:
            values = zero_where_masked(as_float(values).detach().to(rewards.dtype), response_mask)
        with torch.no_grad():
            return self._rule(rewards, response_mask, group_ids, values)


# --- building blocks ----------------------------------------------------------------------------


def sequence_rewards(token_rewards: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """``[B]``: each sample's sum of trained-token rewards."""
    return masked_sum(as_float(token_rewards), response_mask, dim=-1)


def discounted_returns(token_rewards: torch.Tensor, response_mask: torch.Tensor, gamma: float = 1.0) -> torch.Tensor:
    """``G_t = r_t + gamma * G_{t+1}`` over trained tokens (untrained ones skipped), 0 elsewhere."""
    rewards = zero_where_masked(as_float(token_rewards), response_mask)
    trained = response_mask > 0
    returns = torch.zeros_like(rewards)
    running = torch.zeros_like(rewards[:, 0])
    for t in reversed(range(rewards.shape[1])):
        running = torch.where(trained[:, t], rewards[:, t] + gamma * running, running)
        returns[:, t] = torch.where(trained[:, t], running, 0.0)
    return returns


def _group_stats(scores: torch.Tensor, group_ids: Sequence[Any]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per sample: its group's size, mean score and unbiased std (std 0 for a group of one)."""
    index, n_groups = group_index(group_ids, scores.shape[0], device=scores.device)
    zeros = torch.zeros(n_groups, dtype=scores.dtype, device=scores.device)
    counts = zeros.index_add(0, index, torch.ones_like(scores))
    means = zeros.index_add(0, index, scores) / counts
    squared = zeros.index_add(0, index, (scores - means[index]) ** 2)
    stds = (squared / (counts - 1).clamp(min=1)).sqrt()
    return counts[index], means[index], stds[index]


def _per_token(scores: torch.Tensor, response_mask: torch.Tensor, whiten: bool) -> torch.Tensor:
    advantages = zero_where_masked(scores.unsqueeze(-1).expand_as(response_mask).to(scores.dtype), response_mask)
    return masked_whiten(advantages, response_mask) if whiten else advantages


def zero_variance_group_mask(
    rewards: torch.Tensor | Sequence[float], group_ids: Sequence[Any], tol: float = 0.0
) -> torch.Tensor:
    """``[B]`` bool: True for samples whose group's rewards are not all equal, i.e. spread by more
    than ``tol`` (max - min), the ones that carry a group-relative signal. A group of one is
    all-equal. Dynamic sampling keeps the True rows."""
    if isinstance(tol, bool) or not isinstance(tol, (int, float)) or not tol >= 0:
        raise ValueError(f"tol must be a number >= 0, got {tol!r}")
    scores = torch.as_tensor(rewards, dtype=torch.float64)
    if scores.dim() != 1:
        raise ValueError(f"rewards must be one scalar per sample ([B]), got shape {tuple(scores.shape)}")
    index, n_groups = group_index(group_ids, scores.shape[0])
    group_max = torch.full((n_groups,), float("-inf"), dtype=scores.dtype).scatter_reduce(0, index, scores, "amax")
    group_min = torch.full((n_groups,), float("inf"), dtype=scores.dtype).scatter_reduce(0, index, scores, "amin")
    return (group_max - group_min > tol)[index]


# --- the estimators -----------------------------------------------------------------------------


def make_gae(options: opts.GAEOptions | None = None) -> AdvantageEstimatorFn:
    """GAE (Schulman et al. 2016): ``delta_t = r_t + gamma V_{t+1} - V_t``,
    ``A_t = delta_t + gamma lam A_{t+1}``, ``returns = A + V`` (before whitening). Needs ``values``."""
    o = options or opts.GAEOptions()

    def rule(rewards, mask, group_ids, values):
        trained = mask > 0
        advantages = torch.zeros_like(rewards)
        next_value = torch.zeros_like(rewards[:, 0])
        next_advantage = torch.zeros_like(rewards[:, 0])
        for t in reversed(range(rewards.shape[1])):
            delta = rewards[:, t] + o.gamma * next_value - values[:, t]
            advantage = delta + o.gamma * o.lam * next_advantage
            next_advantage = torch.where(trained[:, t], advantage, next_advantage)
            next_value = torch.where(trained[:, t], values[:, t], next_value)
            advantages[:, t] = torch.where(trained[:, t], advantage, 0.0)
        returns = zero_where_masked(advantages + values, mask)
        return (masked_whiten(advantages, mask) if o.whiten else advantages), returns

    return AdvantageEstimatorFn("gae", o, rule, needs_values=True)


def make_grpo(options: opts.GRPOOptions | None = None) -> AdvantageEstimatorFn:
    """GRPO (Shao et al. 2024): ``(r - mean_g) / (std_g + epsilon)``; with ``norm_by_std=False``
    Dr. GRPO's ``r - mean_g`` (Liu et al. 2025). A group of one gets 0."""
    o = options or opts.GRPOOptions()

    def rule(rewards, mask, group_ids, values):
        scores = sequence_rewards(rewards, mask)
        _, mean, std = _group_stats(scores, group_ids)
        centered = scores - mean
        advantages = centered / (std + o.epsilon) if o.norm_by_std else centered
        return _per_token(advantages, mask, o.whiten), discounted_returns(rewards, mask)

    return AdvantageEstimatorFn("grpo", o, rule)


def make_rloo(options: opts.RLOOOptions | None = None) -> AdvantageEstimatorFn:
    """RLOO (Ahmadian et al. 2024): ``r_i - mean_{j != i} r_j = n / (n - 1) * (r_i - mean_g)``.
    A group of one gets 0."""
    o = options or opts.RLOOOptions()

    def rule(rewards, mask, group_ids, values):
        scores = sequence_rewards(rewards, mask)
        size, mean, _ = _group_stats(scores, group_ids)
        advantages = torch.where(size > 1, (scores - mean) * size / (size - 1).clamp(min=1), 0.0)
        return _per_token(advantages, mask, o.whiten), discounted_returns(rewards, mask)

    return AdvantageEstimatorFn("rloo", o, rule)


def make_reinforce_plus_plus(options: opts.ReinforcePlusPlusOptions | None = None) -> AdvantageEstimatorFn:
    """REINFORCE++ (Hu 2025): discounted returns ``G_t``, whitened over every trained token of the
    batch: ``(G_t - mean) / (std + epsilon)``."""
    o = options or opts.ReinforcePlusPlusOptions()

    def rule(rewards, mask, group_ids, values):
        returns = discounted_returns(rewards, mask, o.gamma)
        return masked_whiten(returns, mask, o.epsilon), returns

    return AdvantageEstimatorFn("reinforce++", o, rule)


def make_maxrl(options: opts.MaxRLOptions | None = None) -> AdvantageEstimatorFn:
    """MaxRL (Tajwar et al. 2026, arXiv:2602.02710): ``(r_i - mean_g) / mean_g``, 0 for a group whose
    mean reward is 0 (no success). Rewards must be >= 0 (success indicators in the paper)."""
    o = options or opts.MaxRLOptions()

    def rule(rewards, mask, group_ids, values):
        scores = sequence_rewards(rewards, mask)
        if bool((scores < 0).any()):
            raise ValueError(
                f"maxrl needs non-negative rewards (success indicators), got {scores.min().item():g}; "
                "use grpo or rloo for signed rewards"
            )
        _, mean, _ = _group_stats(scores, group_ids)
        advantages = torch.where(mean > 0, (scores - mean) / torch.where(mean > 0, mean, 1.0), 0.0)
        return _per_token(advantages, mask, o.whiten), discounted_returns(rewards, mask)

    return AdvantageEstimatorFn("maxrl", o, rule)
