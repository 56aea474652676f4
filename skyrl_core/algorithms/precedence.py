"""How algorithm-wide settings combine with the selected policy loss's own options.

The loss reduction has two places to be written: ``algorithm.loss_reduction`` (for whichever loss
is selected) and ``algorithm.policy_loss.options.loss_reduction`` (for that loss). The trainer
reduces with, in order of precedence:

1. the loss's option, when set;
2. ``algorithm.loss_reduction``, when set;
3. the loss's own default (``default_reduction`` of its options class: ``sequence_mean`` for GSPO,
   ``token_mean`` for the others).

Both set to different values is refused: one of them would silently not apply.

This module never imports torch: ``AlgorithmConfig`` validates with it.
"""

from __future__ import annotations

from typing import Any

DEFAULT_REDUCTION = "token_mean"


def effective_loss_reduction(algorithm_reduction: str | None, loss_options: Any) -> str:
    """The reduction the trainer applies (see the module docstring); ``ValueError`` on a contradiction."""
    own = getattr(loss_options, "loss_reduction", None)
    if own is not None and algorithm_reduction is not None and own != algorithm_reduction:
        raise ValueError(
            f"algorithm.loss_reduction={algorithm_reduction!r} contradicts "
            f"algorithm.policy_loss.options.loss_reduction={own!r}; set only one of them"
        )
    if own is not None:
        return own
    if algorithm_reduction is not None:
        return algorithm_reduction
    return getattr(loss_options, "default_reduction", DEFAULT_REDUCTION)


def check_policy_loss_combination(algorithm: Any) -> None:
    """Refuse settings of ``algorithm`` (an ``AlgorithmConfig``) that contradict its policy loss."""
    options = algorithm.policy_loss.options
    effective_loss_reduction(algorithm.loss_reduction, options)
    if getattr(options, "anchor", None) == "rollout" and algorithm.off_policy.tis != "none":
        raise ValueError(
            f"algorithm.policy_loss {algorithm.policy_loss.name!r} with anchor 'rollout' already weights "
            f"by pi / pi_rollout; algorithm.off_policy.tis={algorithm.off_policy.tis!r} would correct the "
            "mismatch twice: set algorithm.off_policy.tis to none"
        )
