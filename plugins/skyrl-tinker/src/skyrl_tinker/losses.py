"""Tinker's loss names mapped onto the core's registered policy losses.

Tinker's losses are *sums* over every position of every datum (no mean): a datum's
``loss_fn_inputs`` are per-position tensors aligned with its ``model_input`` (position ``i``
scores ``target_tokens[i]`` given the tokens up to ``i``). So each core loss is called with
``loss_mask`` = the real positions and ``token_weights`` chosen to give Tinker's sum:

- ``cross_entropy``: ``sum(-logprob * weights)`` (``weights`` default 1). The SDK's client-side
  custom losses (``forward_backward_custom``) arrive as this loss with ``weights = -dC/dlogprob``.
- ``importance_sampling``: ``sum(-exp(logprob - sampler_logprob) * advantage)``.
- ``ppo``: ``sum(-min(r A, clip(r, low, high) A))`` with ``clip_low_threshold`` (default 0.8) and
  ``clip_high_threshold`` (default 1.2) as the ratio bounds.
- ``cispo``: ``sum(-sg(clip(r, low, high)) A logprob)``, same thresholds.
- ``gspo``: the sequence ratio ``exp(mean_t log r)`` clipped, each sequence's tokens weighted
  ``1 / length`` (so each sequence contributes its sequence-level objective), same thresholds
  (default 1 - 3e-4 and 1 + 4e-4, GSPO's own).
- ``dro``: ``sum(-(logprob * A - beta / 2 * (logprob - logprobs)^2))``, ``loss_fn_config``
  ``beta`` (default 0.05, the value Tinker's documentation shows).

``r = exp(logprob - logprobs)`` where ``logprobs`` is the sampler's (``loss_fn_inputs``).
Not built (refused by name): ``stable_reinforce`` and server-side ``custom`` losses.
"""

from __future__ import annotations

import math
from typing import Any

import attrs

RL_INPUTS = ("target_tokens", "logprobs", "advantages")


@attrs.frozen
class LossRule:
    core: str
    required: tuple[str, ...]
    optional: tuple[str, ...] = ()
    thresholds: tuple[float, float] | None = None  # default (low, high) ratio bounds, if clipped
    beta: float | None = None  # default quadratic penalty (``loss_fn_config.beta``), if it takes one


LOSSES: dict[str, LossRule] = {
    "cross_entropy": LossRule("cross_entropy", ("target_tokens",), ("weights",)),
    "importance_sampling": LossRule("importance_sampling", RL_INPUTS),
    "ppo": LossRule("ppo", RL_INPUTS, thresholds=(0.8, 1.2)),
    "cispo": LossRule("cispo", RL_INPUTS, thresholds=(0.8, 1.2)),
    "gspo": LossRule("gspo", RL_INPUTS, thresholds=(1 - 3e-4, 1 + 4e-4)),
    "dro": LossRule("dro", RL_INPUTS, beta=0.05),
}
NOT_BUILT = {
    "stable_reinforce": "stable_reinforce needs the sampler's stability records, which this server does not keep",
    "custom": "server-side custom losses are not built; the SDK runs forward_backward_custom on the client "
    "(this server reports custom_loss_server_side: false)",
}


class LossInputError(ValueError):
    """A request's loss name, config or inputs are not acceptable (a 4xx, nothing computed)."""


def check_loss(name: str, config: dict[str, Any] | None) -> LossRule:
    """The rule for ``name`` after checking ``config``; raises ``LossInputError`` naming the problem."""
    if name in NOT_BUILT:
        raise LossInputError(f"loss_fn {name!r}: {NOT_BUILT[name]}; supported: {', '.join(LOSSES)}")
    rule = LOSSES.get(name)
    if rule is None:
        raise LossInputError(f"loss_fn {name!r} is unknown; supported: {', '.join(LOSSES)}")
    config = dict(config or {})
    allowed = (("clip_low_threshold", "clip_high_threshold") if rule.thresholds else ()) + (
        ("beta",) if rule.beta is not None else ()
    )
    for key, value in config.items():
        if key not in allowed:
            raise LossInputError(
                f"loss_fn_config.{key}: not an option of {name!r}; allowed: {', '.join(allowed) or 'none'}"
            )
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise LossInputError(f"loss_fn_config.{key}: must be a finite number; got {value!r}")
    if rule.thresholds:
        low, high = _thresholds(rule, config)
        if not 0.0 <= low < 1.0:
            raise LossInputError(f"loss_fn_config.clip_low_threshold: must be in [0, 1); got {low!r}")
        if not high > 1.0:
            raise LossInputError(f"loss_fn_config.clip_high_threshold: must be > 1; got {high!r}")
    if rule.beta is not None and not float(config.get("beta", rule.beta)) >= 0.0:
        raise LossInputError(f"loss_fn_config.beta: must be >= 0; got {config['beta']!r}")
    return rule


def _thresholds(rule: LossRule, config: dict[str, Any]) -> tuple[float, float]:
    assert rule.thresholds is not None
    return (
        float(config.get("clip_low_threshold", rule.thresholds[0])),
        float(config.get("clip_high_threshold", rule.thresholds[1])),
    )


def compute_loss(name: str, config: dict[str, Any] | None, logprobs: Any, inputs: dict[str, Any], mask: Any) -> tuple[Any, dict[str, float]]:
    """Tinker loss ``name`` over ``logprobs`` ``[B, T]`` (with gradient), ``inputs`` name ->
    ``[B, T]`` tensors (0 on padding) and ``mask`` ``[B, T]`` (1.0 on real positions)."""
    from skyrl_core import load_policy_loss

    rule = check_loss(name, config)
    options: dict[str, Any] = {}
    if rule.thresholds:
        low, high = _thresholds(rule, dict(config or {}))
        options = {"eps_low": 1.0 - low, "eps_high": high - 1.0}
        if rule.core == "cispo" and low == 0.0:
            options["eps_low"] = 1.0
    if rule.beta is not None:
        options = {"beta": float(dict(config or {}).get("beta", rule.beta))}
    loss_fn = load_policy_loss(rule.core, **options)
    if name == "cross_entropy":
        weights = inputs.get("weights")
        token_weights = mask if weights is None else weights * mask
        return loss_fn(logprobs, None, None, mask, token_weights=token_weights)
    if name == "gspo":
        lengths = mask.sum(-1, keepdim=True).clamp_min(1.0)
        token_weights = mask / lengths
    else:
        token_weights = mask
    sampler = inputs["logprobs"]
    advantages = inputs["advantages"]
    if name in ("importance_sampling", "dro"):
        return loss_fn(logprobs, None, advantages, mask, rollout_logprobs=sampler, token_weights=token_weights)
    return loss_fn(logprobs, sampler, advantages, mask, token_weights=token_weights)

