"""Options of the built-in policy losses and advantage estimators.

Frozen attrs classes, one per algorithm, structured from ``algorithm.policy_loss.options`` /
``algorithm.advantage.options`` (or from ``skyrl_core.load_policy_loss(name, **options)``).
This module never imports torch: validating a config must stay cheap.
"""

from __future__ import annotations

from typing import Any, ClassVar

import attrs

from skyrl_core.config.validators import field_name, is_finite_number, one_of, optional_positive_int

LOSS_REDUCTIONS: tuple[str, ...] = (
    "token_mean", "sequence_mean", "seq_mean_token_sum_norm", "prompt_mean", "token_mean_legacy",
)
DIVERGENCES: tuple[str, ...] = ("binary_tv", "binary_kl")
ANCHORS: tuple[str, ...] = ("old", "rollout")


def _help(text: str) -> dict[str, Any]:
    return {"help": text}


def _number(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{field_name(instance, attribute)} must be a number, got {value!r}")


def _positive(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
    _number(instance, attribute, value)
    if not value > 0:
        raise ValueError(f"{field_name(instance, attribute)} must be > 0, got {value!r}")


def _non_negative(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
    _number(instance, attribute, value)
    if not value >= 0:
        raise ValueError(f"{field_name(instance, attribute)} must be >= 0, got {value!r}")


def _fraction(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
    """In (0, 1]."""
    _number(instance, attribute, value)
    if not 0 < value <= 1:
        raise ValueError(f"{field_name(instance, attribute)} must be in (0, 1], got {value!r}")


def _unit_interval(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
    """In [0, 1]."""
    _number(instance, attribute, value)
    if not 0 <= value <= 1:
        raise ValueError(f"{field_name(instance, attribute)} must be in [0, 1], got {value!r}")


def _greater_than_one(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
    _number(instance, attribute, value)
    if not value > 1:
        raise ValueError(f"{field_name(instance, attribute)} must be > 1, got {value!r}")


_optional_reduction = one_of(*LOSS_REDUCTIONS, optional=True)


def _reduction_field() -> Any:
    # None: algorithm.loss_reduction when set, else the loss's own default_reduction
    # (skyrl_core.algorithms.precedence says how the two combine)
    return attrs.field(
        default=None,
        validator=_optional_reduction,
        metadata=_help("how per-token losses are reduced (null: algorithm.loss_reduction, else the loss's default)"),
    )


def _norm_len_field() -> Any:
    return attrs.field(
        default=None,
        validator=optional_positive_int,
        metadata=_help("constant length for seq_mean_token_sum_norm (default: the batch's response length)"),
    )


def _eps_low_field(default: float) -> Any:
    return attrs.field(default=default, validator=_fraction, metadata=_help("lower clip: ratio >= 1 - eps_low"))


def _eps_high_field(default: float) -> Any:
    return attrs.field(default=default, validator=_positive, metadata=_help("upper clip: ratio <= 1 + eps_high"))


# --- policy losses -----------------------------------------------------------------------------


@attrs.frozen(kw_only=True)
class PPOOptions:
    """PPO clipped surrogate with separate low/high clip (``eps_high > eps_low`` is DAPO's clip-higher)."""

    eps_low: float = _eps_low_field(0.2)
    eps_high: float = _eps_high_field(0.2)
    loss_reduction: str | None = _reduction_field()
    norm_len: int | None = _norm_len_field()


@attrs.frozen(kw_only=True)
class DualClipOptions:
    """PPO clip plus a lower bound ``-clip_ratio_c * A`` on the loss of negative-advantage tokens."""

    eps_low: float = _eps_low_field(0.2)
    eps_high: float = _eps_high_field(0.2)
    clip_ratio_c: float = attrs.field(
        default=3.0, validator=_greater_than_one, metadata=_help("dual-clip constant c (> 1)")
    )
    loss_reduction: str | None = _reduction_field()
    norm_len: int | None = _norm_len_field()


@attrs.frozen(kw_only=True)
class GSPOOptions:
    """Sequence-level ratio (geometric mean of token ratios) clipped per sequence."""

    default_reduction: ClassVar[str] = "sequence_mean"
    eps_low: float = _eps_low_field(3e-4)
    eps_high: float = _eps_high_field(4e-4)
    loss_reduction: str | None = _reduction_field()
    norm_len: int | None = _norm_len_field()


@attrs.frozen(kw_only=True)
class CISPOOptions:
    """REINFORCE weighted by a clipped, stop-gradient importance ratio (no lower bound by default)."""

    eps_low: float = attrs.field(
        default=1.0, validator=_fraction, metadata=_help("lower clip of the IS weight (1.0: no lower bound)")
    )
    eps_high: float = _eps_high_field(0.28)
    anchor: str = attrs.field(
        default="old",
        validator=one_of(*ANCHORS),
        metadata=_help("behaviour policy of the ratio: old (pi / pi_old) or rollout (pi / pi_rollout, no TIS on top)"),
    )
    loss_reduction: str | None = _reduction_field()
    norm_len: int | None = _norm_len_field()


@attrs.frozen(kw_only=True)
class SAPOOptions:
    """Soft sigmoid gate ``4/tau * sigmoid(tau * (ratio - 1))`` instead of a hard clip."""

    tau_pos: float = attrs.field(default=1.0, validator=_positive, metadata=_help("gate temperature for A > 0"))
    tau_neg: float = attrs.field(default=1.05, validator=_positive, metadata=_help("gate temperature for A <= 0"))
    loss_reduction: str | None = _reduction_field()
    norm_len: int | None = _norm_len_field()


@attrs.frozen(kw_only=True)
class ClipCovOptions:
    """PPO clip, plus a random few unclipped tokens whose covariance(logp, A) lies in a band get no gradient."""

    eps_low: float = _eps_low_field(0.2)
    eps_high: float = _eps_high_field(0.2)
    clip_ratio: float = attrs.field(
        default=2e-4, validator=_fraction, metadata=_help("fraction of trained tokens to detach")
    )
    cov_low: float = attrs.field(default=1.0, validator=_number, metadata=_help("lower covariance bound of the band"))
    cov_high: float = attrs.field(default=5.0, validator=_number, metadata=_help("upper covariance bound of the band"))
    seed: int = attrs.field(default=0, metadata=_help("seed of the random token choice"))
    loss_reduction: str | None = _reduction_field()
    norm_len: int | None = _norm_len_field()

    def __attrs_post_init__(self) -> None:
        if self.cov_low > self.cov_high:
            raise ValueError(
                f"ClipCovOptions.cov_low must be <= cov_high, got cov_low={self.cov_low!r} cov_high={self.cov_high!r}"
            )


@attrs.frozen(kw_only=True)
class KLCovOptions:
    """Policy gradient plus a ``|logp - old_logp|`` penalty on the tokens of highest covariance."""

    kl_ratio: float = attrs.field(
        default=2e-3, validator=_fraction, metadata=_help("fraction of trained tokens that get the penalty")
    )
    kl_coef: float = attrs.field(default=1.0, validator=_non_negative, metadata=_help("penalty coefficient"))
    loss_reduction: str | None = _reduction_field()
    norm_len: int | None = _norm_len_field()


@attrs.frozen(kw_only=True)
class RolloutISOptions:
    """Token-masked IS on the rollout policy: ``-sg(r * 1[1 - eps_low < r < 1 + eps_high]) * A * log pi``,
    ``r = pi / pi_rollout``."""

    eps_low: float = attrs.field(
        default=0.2, validator=_fraction, metadata=_help("tokens with r <= 1 - eps_low get no gradient")
    )
    eps_high: float = attrs.field(
        default=0.2, validator=_positive, metadata=_help("tokens with r >= 1 + eps_high get no gradient")
    )
    loss_reduction: str | None = _reduction_field()
    norm_len: int | None = _norm_len_field()


@attrs.frozen(kw_only=True)
class DPPOOptions:
    """Trust region from a binary divergence between the sampled token's behaviour (rollout) and new
    probability."""

    divergence: str = attrs.field(
        default="binary_tv", validator=one_of(*DIVERGENCES), metadata=_help("binary_tv or binary_kl")
    )
    delta_low: float = attrs.field(
        default=0.15, validator=_positive, metadata=_help("threshold when the token's probability went down")
    )
    delta_high: float = attrs.field(
        default=0.15, validator=_positive, metadata=_help("threshold when the token's probability went up")
    )
    clip_ratio_c: float = attrs.field(
        default=20.0, validator=_positive, metadata=_help("upper bound of the (stop-gradient) ratio weight")
    )
    loss_reduction: str | None = _reduction_field()
    norm_len: int | None = _norm_len_field()


@attrs.frozen(kw_only=True)
class CrossEntropyOptions:
    """Supervised negative log-likelihood of the trained tokens (SFT)."""

    loss_reduction: str | None = _reduction_field()
    norm_len: int | None = _norm_len_field()


@attrs.frozen(kw_only=True)
class ImportanceSamplingOptions:
    """Tinker's ``importance_sampling``: ``-(pi / pi_sampler) * A``, no clip."""

    loss_reduction: str | None = _reduction_field()
    norm_len: int | None = _norm_len_field()


def _finite_non_negative(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
    if not (is_finite_number(value) and value >= 0):
        raise ValueError(f"{field_name(instance, attribute)} must be a finite number >= 0, got {value!r}")


@attrs.frozen(kw_only=True)
class DROOptions:
    """DRO: ``-(log pi * A - beta / 2 * (log pi - log pi_sampler)^2)``."""

    beta: float = attrs.field(
        default=0.05, validator=_finite_non_negative,
        metadata=_help("weight of the quadratic penalty on log(pi / pi_sampler) (Tinker's example value 0.05)"),
    )
    loss_reduction: str | None = _reduction_field()
    norm_len: int | None = _norm_len_field()


# --- advantage estimators ----------------------------------------------------------------------


def _gamma_field() -> Any:
    return attrs.field(default=1.0, validator=_unit_interval, metadata=_help("discount factor in [0, 1]"))


def _whiten_field(default: bool = False) -> Any:
    return attrs.field(default=default, metadata=_help("whiten advantages over the whole batch's trained tokens"))


@attrs.frozen(kw_only=True)
class GAEOptions:
    """Generalized advantage estimation from a critic's values."""

    gamma: float = _gamma_field()
    lam: float = attrs.field(default=1.0, validator=_unit_interval, metadata=_help("GAE lambda in [0, 1]"))
    whiten: bool = _whiten_field(True)


@attrs.frozen(kw_only=True)
class GRPOOptions:
    """Group-relative advantage; ``norm_by_std: false`` is Dr. GRPO."""

    norm_by_std: bool = attrs.field(default=True, metadata=_help("divide by the group's std (false: Dr. GRPO)"))
    epsilon: float = attrs.field(default=1e-6, validator=_positive, metadata=_help("added to the std"))
    whiten: bool = _whiten_field()


@attrs.frozen(kw_only=True)
class RLOOOptions:
    """Leave-one-out baseline within each group."""

    whiten: bool = _whiten_field()


@attrs.frozen(kw_only=True)
class ReinforcePlusPlusOptions:
    """Discounted returns whitened over the whole batch."""

    gamma: float = _gamma_field()
    epsilon: float = attrs.field(default=1e-8, validator=_positive, metadata=_help("added to the batch std"))


@attrs.frozen(kw_only=True)
class MaxRLOptions:
    """Group advantage normalised by the group's mean reward (MaxRL)."""

    whiten: bool = _whiten_field()
