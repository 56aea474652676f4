"""The core's algorithms, registered as a built-in plugin through the same hook third parties use.

Imports records only: the losses (and torch) load when a name is selected.
"""

from __future__ import annotations

from typing import Callable

from skyrl_core.plugins import hookimpl
from skyrl_core.plugins.records import AdvantageEstimatorSpec, PolicyLossSpec

_LOSSES = "skyrl_core.algorithms.policy_losses"
_ESTIMATORS = "skyrl_core.algorithms.advantages"
_OPTIONS = "skyrl_core.algorithms.options"

# (name, factory, options class, description)
POLICY_LOSSES: tuple[tuple[str, str, str, str], ...] = (
    ("ppo", "make_ppo", "PPOOptions", "PPO clipped surrogate with separate low/high clip"),
    ("dual_clip", "make_dual_clip", "DualClipOptions", "PPO clip with a lower bound for negative advantages"),
    ("gspo", "make_gspo", "GSPOOptions", "GSPO: clipped sequence-level (geometric mean) ratio"),
    ("cispo", "make_cispo", "CISPOOptions", "CISPO: REINFORCE weighted by a clipped stop-gradient ratio"),
    ("sapo", "make_sapo", "SAPOOptions", "SAPO: soft sigmoid gate instead of a hard clip"),
    ("clip_cov", "make_clip_cov", "ClipCovOptions", "Clip-Cov: drop a few high-covariance tokens"),
    ("kl_cov", "make_kl_cov", "KLCovOptions", "KL-Cov: KL penalty on the highest-covariance tokens"),
    ("rollout_is", "make_rollout_is", "RolloutISOptions", "PPO clip times truncated IS weight pi_old/pi_rollout"),
    ("dppo", "make_dppo", "DPPOOptions", "DPPO: trust region from binary TV or binary KL divergence"),
    ("cross_entropy", "make_cross_entropy", "CrossEntropyOptions", "supervised negative log-likelihood (SFT)"),
    ("importance_sampling", "make_importance_sampling", "ImportanceSamplingOptions",
     "Tinker importance_sampling: -(pi/pi_sampler)*A, no clip"),
    ("dro", "make_dro", "DROOptions", "DRO: -(log pi * A) plus a quadratic penalty on log(pi/pi_sampler)"),
)

ADVANTAGE_ESTIMATORS: tuple[tuple[str, str, str, str], ...] = (
    ("gae", "make_gae", "GAEOptions", "generalized advantage estimation from a critic"),
    ("grpo", "make_grpo", "GRPOOptions", "group-relative advantage (norm_by_std: false is Dr. GRPO)"),
    ("rloo", "make_rloo", "RLOOOptions", "leave-one-out group baseline"),
    ("reinforce++", "make_reinforce_plus_plus", "ReinforcePlusPlusOptions",
     "discounted returns whitened over the batch"),
    ("maxrl", "make_maxrl", "MaxRLOptions", "MaxRL: group advantage normalised by the mean reward"),
)


@hookimpl
def skyrl_register_algorithms(register: Callable[[PolicyLossSpec | AdvantageEstimatorSpec], None]) -> None:
    for name, factory, options, description in POLICY_LOSSES:
        register(PolicyLossSpec(name=name, factory=f"{_LOSSES}:{factory}", options=f"{_OPTIONS}:{options}",
                                description=description))
    for name, factory, options, description in ADVANTAGE_ESTIMATORS:
        register(AdvantageEstimatorSpec(name=name, factory=f"{_ESTIMATORS}:{factory}",
                                        options=f"{_OPTIONS}:{options}", description=description))
