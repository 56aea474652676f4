"""The built-in policy losses.

Each ``make_<name>(options)`` returns a ``PolicyLossFn``: a callable

    loss_fn(logprobs, old_logprobs, advantages, loss_mask, rollout_logprobs=None,
            *, token_weights=None, group_ids=None) -> (loss, metrics)

over ``[B, R]`` tensors (``loss_mask`` 1.0 on trained tokens). The scalar ``loss`` is
``sum(per_token_loss * w)`` where ``w = token_weights`` when given (the trainer computes them over
the whole mini-batch with ``reduction_weights`` so that micro-batches sum exactly), otherwise
``reduction_weights(loss_mask, reduction, group_ids, options.norm_len)`` with ``reduction`` the
options' ``loss_reduction`` or, when that is None, the loss's ``default_reduction``.
``metrics`` are Python floats over this call's trained tokens.

Untrained positions never matter: their inputs are replaced by 0 before any arithmetic, so inf or
nan there reaches neither the loss nor a gradient. Log-ratios are clamped to
``[-LOG_RATIO_LIMIT, LOG_RATIO_LIMIT]`` before ``exp`` so extreme ratios stay finite (a token
beyond the clamp gets no gradient through its ratio). Formulas and references: docs/algorithms.md.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import torch

from skyrl_core.algorithms import options as opts
from skyrl_core.algorithms.precedence import effective_loss_reduction
from skyrl_core.algorithms.reductions import reduction_weights
from skyrl_core.algorithms.tensor_utils import (
    as_float,
    check_shapes,
    masked_mean,
    masked_scalar,
    masked_sum,
    zero_where_masked,
)

LOG_RATIO_LIMIT = 20.0


class LossInputs:
    """The validated, float, masked inputs of one loss call."""

    def __init__(
        self,
        name: str,
        logprobs: torch.Tensor,
        old_logprobs: torch.Tensor | None,
        advantages: torch.Tensor | None,
        loss_mask: torch.Tensor,
        rollout_logprobs: torch.Tensor | None,
        *,
        needs_old: bool,
        needs_advantages: bool,
        needs_rollout: bool,
    ) -> None:
        for arg, value, needed in (
            ("old_logprobs", old_logprobs, needs_old),
            ("advantages", advantages, needs_advantages),
            ("rollout_logprobs", rollout_logprobs, needs_rollout),
        ):
            if needed and value is None:
                raise ValueError(f"policy loss {name!r} needs {arg}, got None")
        check_shapes(
            "logprobs",
            logprobs,
            old_logprobs=old_logprobs,
            advantages=advantages,
            loss_mask=loss_mask,
            rollout_logprobs=rollout_logprobs,
        )
        self.mask = loss_mask
        self.logprobs = zero_where_masked(as_float(logprobs), loss_mask)

        def clean(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else zero_where_masked(as_float(t).detach(), loss_mask)

        self.old_logprobs = clean(old_logprobs)
        self.advantages = clean(advantages)
        self.rollout_logprobs = clean(rollout_logprobs)

    def log_ratio(self, behaviour: torch.Tensor | None = None) -> torch.Tensor:
        """``log(pi / pi_behaviour)`` (default behaviour: old policy), clamped, with gradient."""
        reference = self.old_logprobs if behaviour is None else behaviour
        return (self.logprobs - reference).clamp(-LOG_RATIO_LIMIT, LOG_RATIO_LIMIT)

    def ratio_metrics(self, ratio: torch.Tensor) -> dict[str, float]:
        with torch.no_grad():
            ratio = ratio.detach()
            approx_kl = ratio - 1 - ratio.log()  # k3 estimate of KL(pi_old || pi)
        return {
            "ratio_mean": masked_scalar(ratio, self.mask, "mean"),
            "ratio_max": masked_scalar(ratio, self.mask, "max"),
            "ratio_min": masked_scalar(ratio, self.mask, "min"),
            "approx_kl": masked_scalar(approx_kl, self.mask, "mean"),
        }

    def fraction(self, flags: torch.Tensor) -> float:
        return masked_scalar(flags.to(self.logprobs.dtype), self.mask, "mean")


PerTokenLoss = Callable[[LossInputs], "tuple[torch.Tensor, dict[str, float]]"]


class PolicyLossFn:
    """A built policy loss: ``name``, its ``options``, and the per-token rule it reduces."""

    def __init__(
        self,
        name: str,
        options: Any,
        per_token: PerTokenLoss,
        *,
        needs_old: bool = True,
        needs_advantages: bool = True,
        needs_rollout: bool = False,
    ) -> None:
        self.name = name
        self.options = options
        self._per_token = per_token
        self._needs = {"needs_old": needs_old, "needs_advantages": needs_advantages, "needs_rollout": needs_rollout}

    def __repr__(self) -> str:
        return f"PolicyLossFn({self.name!r}, {self.options!r})"

    def __call__(
        self,
        logprobs: torch.Tensor,
        old_logprobs: torch.Tensor | None,
        advantages: torch.Tensor | None,
        loss_mask: torch.Tensor,
        rollout_logprobs: torch.Tensor | None = None,
        *,
        token_weights: torch.Tensor | None = None,
        group_ids: Sequence[Any] | None = None,
        **unused: Any,  # keywords other losses take (values, returns): a trainer passes one set to any loss
    ) -> tuple[torch.Tensor, dict[str, float]]:
        inputs = LossInputs(self.name, logprobs, old_logprobs, advantages, loss_mask, rollout_logprobs, **self._needs)
        per_token_loss, metrics = self._per_token(inputs)
        if token_weights is None:
            reduction = effective_loss_reduction(None, self.options)
            weights = reduction_weights(loss_mask, reduction, group_ids, self.options.norm_len)
        else:
            check_shapes("logprobs", logprobs, token_weights=token_weights)
            weights = token_weights
        loss = masked_sum(per_token_loss * as_float(weights).detach(), loss_mask)
        return loss, metrics


def _clipped_surrogate(
    ratio: torch.Tensor, advantages: torch.Tensor, eps_low: float, eps_high: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """PPO's ``max(-r A, -clip(r, 1 - eps_low, 1 + eps_high) A)`` and where the clipped term wins
    (those tokens get zero gradient)."""
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1 - eps_low, 1 + eps_high)
    return torch.maximum(unclipped, clipped), clipped > unclipped


# --- the losses ---------------------------------------------------------------------------------


def make_ppo(options: opts.PPOOptions | None = None) -> PolicyLossFn:
    """PPO clipped surrogate (Schulman et al. 2017) with separate low/high clip (DAPO clip-higher)."""
    o = options or opts.PPOOptions()

    def per_token(x: LossInputs) -> tuple[torch.Tensor, dict[str, float]]:
        ratio = x.log_ratio().exp()
        loss, clipped = _clipped_surrogate(ratio, x.advantages, o.eps_low, o.eps_high)
        return loss, {**x.ratio_metrics(ratio), "clip_frac": x.fraction(clipped)}

    return PolicyLossFn("ppo", o, per_token)


def make_dual_clip(options: opts.DualClipOptions | None = None) -> PolicyLossFn:
    """Dual-clip PPO (Ye et al. 2020): for ``A < 0`` the loss is at most ``-c A``."""
    o = options or opts.DualClipOptions()

    def per_token(x: LossInputs) -> tuple[torch.Tensor, dict[str, float]]:
        ratio = x.log_ratio().exp()
        ppo_loss, clipped = _clipped_surrogate(ratio, x.advantages, o.eps_low, o.eps_high)
        bound = -o.clip_ratio_c * x.advantages
        lower_clipped = (x.advantages < 0) & (ppo_loss > bound)
        loss = torch.where(lower_clipped, bound, ppo_loss)
        return loss, {
            **x.ratio_metrics(ratio),
            "clip_frac": x.fraction(clipped | lower_clipped),
            "dual_clip_frac": x.fraction(lower_clipped),
        }

    return PolicyLossFn("dual_clip", o, per_token)


def make_gspo(options: opts.GSPOOptions | None = None) -> PolicyLossFn:
    """GSPO (Zheng et al. 2025) in its token form: every token carries the sequence ratio
    ``s_i = exp(mean_t log(pi/pi_old))`` as value, and with a sequence-mean reduction its gradient
    is exactly that of the sequence-level objective."""
    o = options or opts.GSPOOptions()

    def per_token(x: LossInputs) -> tuple[torch.Tensor, dict[str, float]]:
        token_log_ratio = x.logprobs - x.old_logprobs
        seq_log_ratio = masked_mean(token_log_ratio, x.mask, dim=-1).clamp(-LOG_RATIO_LIMIT, LOG_RATIO_LIMIT)
        # GSPO-token: value s_i on every token, gradient s_i * grad(log pi(y_t)); the reduction's
        # 1 / L_i then gives the sequence objective's s_i / L_i.
        log_ratio = seq_log_ratio.detach().unsqueeze(-1) + (x.logprobs - x.logprobs.detach())
        ratio = log_ratio.exp()
        loss, clipped = _clipped_surrogate(ratio, x.advantages, o.eps_low, o.eps_high)
        return loss, {**x.ratio_metrics(ratio), "clip_frac": x.fraction(clipped)}

    return PolicyLossFn("gspo", o, per_token)


def make_cispo(options: opts.CISPOOptions | None = None) -> PolicyLossFn:
    """CISPO (MiniMax-M1, 2025): ``-sg(clip(r, 1 - eps_low, 1 + eps_high)) * A * log pi``; every
    token keeps a gradient, only its weight is clipped. ``r = pi / pi_old``, or with
    ``anchor="rollout"`` ``r = pi / pi_rollout`` (the ratio then is the off-policy correction)."""
    o = options or opts.CISPOOptions()
    on_rollout = o.anchor == "rollout"

    def per_token(x: LossInputs) -> tuple[torch.Tensor, dict[str, float]]:
        ratio = x.log_ratio(x.rollout_logprobs if on_rollout else None).exp()
        weight = ratio.clamp(1 - o.eps_low, 1 + o.eps_high).detach()
        loss = -weight * x.advantages * x.logprobs
        truncated = (ratio < 1 - o.eps_low) | (ratio > 1 + o.eps_high)
        return loss, {**x.ratio_metrics(ratio), "clip_frac": x.fraction(truncated)}

    return PolicyLossFn("cispo", o, per_token, needs_old=not on_rollout, needs_rollout=on_rollout)


def make_sapo(options: opts.SAPOOptions | None = None) -> PolicyLossFn:
    """SAPO (Gao et al. 2025): ``-(4 / tau) * sigmoid(tau * (r - 1)) * A``, ``tau`` by the sign of A."""
    o = options or opts.SAPOOptions()

    def per_token(x: LossInputs) -> tuple[torch.Tensor, dict[str, float]]:
        ratio = x.log_ratio().exp()
        tau = torch.full_like(ratio, o.tau_neg).masked_fill(x.advantages > 0, o.tau_pos)
        gate = torch.sigmoid(tau * (ratio - 1)) * (4 / tau)
        return -gate * x.advantages, {**x.ratio_metrics(ratio), "gate_mean": masked_scalar(gate, x.mask)}

    return PolicyLossFn("sapo", o, per_token)


def _centered_covariance(x: LossInputs) -> torch.Tensor:
    """Per-token ``(logp - mean logp) * (A - mean A)`` over this call's trained tokens (no gradient)."""
    logprobs = x.logprobs.detach()
    cov = (logprobs - masked_mean(logprobs, x.mask)) * (x.advantages - masked_mean(x.advantages, x.mask))
    return zero_where_masked(cov, x.mask)


def make_clip_cov(options: opts.ClipCovOptions | None = None) -> PolicyLossFn:
    """Clip-Cov (Cui et al. 2025): PPO's clipped surrogate, where a random share of
    ``clip_ratio * trained tokens`` among the tokens PPO did not clip and whose covariance lies
    strictly inside ``(cov_low, cov_high)`` is dropped (0 loss, 0 grad).

    The covariance and the choice use this call's tokens: with micro-batches they are per micro-batch.
    """
    o = options or opts.ClipCovOptions()
    generator = torch.Generator().manual_seed(o.seed)

    def per_token(x: LossInputs) -> tuple[torch.Tensor, dict[str, float]]:
        ratio = x.log_ratio().exp()
        ppo_loss, clipped = _clipped_surrogate(ratio, x.advantages, o.eps_low, o.eps_high)
        cov = _centered_covariance(x)
        valid = x.mask > 0
        in_band = (cov > o.cov_low) & (cov < o.cov_high)
        candidates = (valid & ~clipped & in_band).flatten().nonzero().squeeze(-1)
        n_select = min(max(1, int(o.clip_ratio * int(valid.sum()))), candidates.numel())
        chosen = candidates[torch.randperm(candidates.numel(), generator=generator)[:n_select].to(candidates.device)]
        dropped = torch.zeros(valid.numel(), dtype=torch.bool, device=valid.device)
        dropped[chosen] = True
        dropped = dropped.view_as(valid)
        loss = torch.where(dropped, torch.zeros_like(ppo_loss), ppo_loss)
        return loss, {
            **x.ratio_metrics(ratio),
            "clip_frac": x.fraction(clipped),
            "cov_dropped_frac": x.fraction(dropped),
        }

    return PolicyLossFn("clip_cov", o, per_token)


def make_kl_cov(options: opts.KLCovOptions | None = None) -> PolicyLossFn:
    """KL-Cov (Cui et al. 2025): policy gradient ``-r A`` plus ``kl_coef * |logp - old_logp|`` on the
    top ``kl_ratio`` share of trained tokens by covariance (per call, like Clip-Cov)."""
    o = options or opts.KLCovOptions()

    def per_token(x: LossInputs) -> tuple[torch.Tensor, dict[str, float]]:
        ratio = x.log_ratio().exp()
        valid = x.mask > 0
        n_valid = int(valid.sum())
        penalised = torch.zeros(valid.numel(), dtype=torch.bool, device=valid.device)
        if n_valid:
            cov = _centered_covariance(x).masked_fill(~valid, float("-inf")).flatten()
            penalised[torch.topk(cov, max(1, int(o.kl_ratio * n_valid))).indices] = True
        penalised = penalised.view_as(valid)
        penalty = o.kl_coef * (x.logprobs - x.old_logprobs).abs()
        loss = -ratio * x.advantages + torch.where(penalised, penalty, torch.zeros_like(penalty))
        return loss, {**x.ratio_metrics(ratio), "kl_penalised_frac": x.fraction(penalised)}

    return PolicyLossFn("kl_cov", o, per_token)


def make_rollout_is(options: opts.RolloutISOptions | None = None) -> PolicyLossFn:
    """Token-masked importance sampling on the rollout policy (GLM-5's agentic loss, upstream SkyRL's
    ``rollout_is``): ``-sg(r * 1[1 - eps_low < r < 1 + eps_high]) * A * log pi`` with
    ``r = pi / pi_rollout``. A token outside the band gets no loss and no gradient; inside, the
    gradient is the importance-weighted policy gradient. Needs ``rollout_logprobs``, not old logprobs."""
    o = options or opts.RolloutISOptions()

    def per_token(x: LossInputs) -> tuple[torch.Tensor, dict[str, float]]:
        ratio = x.log_ratio(x.rollout_logprobs).exp()
        in_band = (ratio > 1 - o.eps_low) & (ratio < 1 + o.eps_high)
        weight = torch.where(in_band, ratio, torch.zeros_like(ratio)).detach()
        return -weight * x.advantages * x.logprobs, {**x.ratio_metrics(ratio), "clip_frac": x.fraction(~in_band)}

    return PolicyLossFn("rollout_is", o, per_token, needs_old=False, needs_rollout=True)


def make_dppo(options: opts.DPPOOptions | None = None) -> PolicyLossFn:
    """DPPO (Qi et al. 2026): ``-sg(min(r, C)) * M * A * log pi`` with ``r = pi / mu`` where the mask
    ``M`` drops a token whose binary divergence between ``mu(y_t)`` and ``pi(y_t)`` exceeds
    ``delta_high`` (probability went up, A > 0) or ``delta_low`` (probability went down, A <= 0).
    The behaviour policy ``mu`` is the rollout policy (``rollout_logprobs``, as in the paper's
    section 5.2), or the old policy when the batch has no rollout logprobs."""
    o = options or opts.DPPOOptions()
    # keep 1 - p away from 0 in the binary KL's log(1 - p) (float32 resolution)
    one_minus_floor = 1e-7

    def per_token(x: LossInputs) -> tuple[torch.Tensor, dict[str, float]]:
        behaviour = x.rollout_logprobs if x.rollout_logprobs is not None else x.old_logprobs
        if behaviour is None:
            raise ValueError("policy loss 'dppo' needs rollout_logprobs or old_logprobs, got None for both")
        log_ratio = x.log_ratio(behaviour)
        logprobs = x.logprobs.detach()
        p, mu = logprobs.exp(), behaviour.exp()
        if o.divergence == "binary_tv":
            divergence = (p - mu).abs()
        else:  # binary_kl: KL(Bernoulli(mu) || Bernoulli(p))
            divergence = mu * (behaviour - logprobs) + (1 - mu) * (
                torch.log1p(-mu.clamp(max=1 - one_minus_floor)) - torch.log1p(-p.clamp(max=1 - one_minus_floor))
            )
        went_up_too_far = (divergence > o.delta_high) & (p > mu)
        went_down_too_far = (divergence > o.delta_low) & (p < mu)
        keep = torch.where(x.advantages > 0, ~went_up_too_far, ~went_down_too_far)
        weight = log_ratio.exp().clamp(max=o.clip_ratio_c).detach()
        loss = -weight * keep.to(weight.dtype) * x.advantages * x.logprobs
        return loss, {
            **x.ratio_metrics(log_ratio.exp()),
            "clip_frac": x.fraction(~keep),
            "divergence_mean": masked_scalar(divergence, x.mask),
        }

    return PolicyLossFn("dppo", o, per_token, needs_old=False)


def make_cross_entropy(options: opts.CrossEntropyOptions | None = None) -> PolicyLossFn:
    """Supervised fine-tuning: ``-log pi``. ``old_logprobs`` and ``advantages`` may be None."""
    o = options or opts.CrossEntropyOptions()

    def per_token(x: LossInputs) -> tuple[torch.Tensor, dict[str, float]]:
        return -x.logprobs, {"nll": masked_scalar(-x.logprobs, x.mask)}

    return PolicyLossFn("cross_entropy", o, per_token, needs_old=False, needs_advantages=False)


def make_importance_sampling(options: opts.ImportanceSamplingOptions | None = None) -> PolicyLossFn:
    """Tinker's ``importance_sampling``: ``-(pi / pi_sampler) * A`` with no clip; the sampler's
    logprobs are ``rollout_logprobs`` when given, else ``old_logprobs``."""
    o = options or opts.ImportanceSamplingOptions()

    def per_token(x: LossInputs) -> tuple[torch.Tensor, dict[str, float]]:
        sampler = x.rollout_logprobs if x.rollout_logprobs is not None else x.old_logprobs
        if sampler is None:
            raise ValueError("policy loss 'importance_sampling' needs rollout_logprobs or old_logprobs, got None for both")
        ratio = x.log_ratio(sampler).exp()
        return -ratio * x.advantages, x.ratio_metrics(ratio)

    return PolicyLossFn("importance_sampling", o, per_token, needs_old=False)


def make_dro(options: opts.DROOptions | None = None) -> PolicyLossFn:
    """DRO (Richemond et al. 2024), as Tinker's ``dro`` loss: ``-(log pi * A - beta / 2 *
    (log pi - log pi_sampler)^2)``, off-policy with no ratio: the quadratic term keeps the policy
    near the sampler's. The sampler's logprobs are ``rollout_logprobs`` when given, else
    ``old_logprobs``. The difference is not clamped (no exponential to overflow)."""
    o = options or opts.DROOptions()

    def per_token(x: LossInputs) -> tuple[torch.Tensor, dict[str, float]]:
        sampler = x.rollout_logprobs if x.rollout_logprobs is not None else x.old_logprobs
        if sampler is None:
            raise ValueError("policy loss 'dro' needs rollout_logprobs or old_logprobs, got None for both")
        difference = x.logprobs - sampler
        penalty = 0.5 * o.beta * difference.square()
        return penalty - x.logprobs * x.advantages, {
            "penalty_mean": masked_scalar(penalty.detach(), x.mask),
            "log_ratio_mean": masked_scalar(difference.detach(), x.mask),
        }

    return PolicyLossFn("dro", o, per_token, needs_old=False)
