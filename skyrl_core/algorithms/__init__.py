"""The built-in RL algorithms: policy losses, advantage estimators, reductions, KL, entropy,
value loss and off-policy correction (registered by ``skyrl_core.algorithms.plugin``).

Names below are imported on first use, so importing this package (as the plugin module does) never
imports torch.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS: dict[str, str] = {
    # reductions
    "reduction_weights": "reductions",
    "LOSS_REDUCTIONS": "options",
    # policy losses
    "PolicyLossFn": "policy_losses",
    "make_ppo": "policy_losses",
    "make_dual_clip": "policy_losses",
    "make_gspo": "policy_losses",
    "make_cispo": "policy_losses",
    "make_sapo": "policy_losses",
    "make_clip_cov": "policy_losses",
    "make_kl_cov": "policy_losses",
    "make_rollout_is": "policy_losses",
    "make_dppo": "policy_losses",
    "make_cross_entropy": "policy_losses",
    "make_importance_sampling": "policy_losses",
    # advantage estimators
    "AdvantageEstimatorFn": "advantages",
    "make_gae": "advantages",
    "make_grpo": "advantages",
    "make_rloo": "advantages",
    "make_reinforce_plus_plus": "advantages",
    "make_maxrl": "advantages",
    "sequence_rewards": "advantages",
    "discounted_returns": "advantages",
    "zero_variance_group_mask": "advantages",
    # KL, entropy, critic, off-policy
    "KL_ESTIMATORS": "kl",
    "kl_estimate": "kl",
    "kl_loss": "kl",
    "apply_kl_penalty": "kl",
    "FixedKLController": "kl",
    "AdaptiveKLController": "kl",
    "entropy_from_logits": "entropy",
    "entropy_bonus": "entropy",
    "value_loss": "critic",
    "off_policy_correction": "off_policy",
    "mismatch_metrics": "off_policy",
    "masked_mean": "tensor_utils",
    "masked_whiten": "tensor_utils",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'skyrl_core.algorithms' has no attribute {name!r}")
    return getattr(importlib.import_module(f"skyrl_core.algorithms.{module}"), name)
