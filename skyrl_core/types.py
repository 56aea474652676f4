"""Data types that cross plugin boundaries. Plain attrs records; tensors are torch tensors.

This module never imports torch at import time (type hints only), so it is cheap to import.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, NamedTuple

import attrs

if TYPE_CHECKING:
    import torch

# --- execution contract ---------------------------------------------------------------------------


def _needs_identical_logprobs(instance: Any, attribute: attrs.Attribute, value: bool) -> None:
    if value and not instance.identical_logprobs:
        raise ValueError("reuse_rollout_logprobs=True needs identical_logprobs=True")


@attrs.frozen(kw_only=True)
class HandshakeVerdict:
    """One plugin's answer to the trainer/engine contract handshake (``skyrl_verify_handshake``).

    ``mismatches``: every reason the two sides do not compute the same numerics (empty: none found);
    any mismatch stops the run before a weight sync. ``identical_logprobs``: the plugin vouches that
    the engine's token logprobs are the trainer's, bit for bit. ``reuse_rollout_logprobs``: the RL
    loop may take the rollout logprobs as the old logprobs and skip that forward pass (only with
    identical logprobs).
    """

    mismatches: tuple[str, ...] = attrs.field(default=(), converter=tuple)
    identical_logprobs: bool = False
    reuse_rollout_logprobs: bool = attrs.field(default=False, validator=_needs_identical_logprobs)

    @classmethod
    def combine(cls, verdicts: list[HandshakeVerdict]) -> HandshakeVerdict:
        """All plugins' verdicts as one: every mismatch; a plugin's vouching counts only when no
        plugin found a mismatch."""
        mismatches = tuple(m for v in verdicts for m in v.mismatches)
        identical = not mismatches and any(v.identical_logprobs for v in verdicts)
        reuse = identical and any(v.reuse_rollout_logprobs for v in verdicts)
        return cls(mismatches=mismatches, identical_logprobs=identical, reuse_rollout_logprobs=reuse)


# --- generation --------------------------------------------------------------------------------


@attrs.frozen(kw_only=True)
class SamplingParams:
    """How to sample one request. ``top_k=0`` and ``top_p=1.0`` disable those filters."""

    max_tokens: int = 64
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    n: int = 1
    seed: int | None = None
    stop: tuple[str, ...] = attrs.field(default=(), converter=tuple)
    stop_token_ids: tuple[int, ...] = attrs.field(default=(), converter=tuple)


@attrs.frozen(kw_only=True)
class GenerationRequest:
    """One prompt (as token ids) to sample ``sampling.n`` continuations of."""

    request_id: str
    prompt_token_ids: tuple[int, ...] = attrs.field(converter=tuple)
    sampling: SamplingParams = SamplingParams()


@attrs.frozen(kw_only=True)
class GeneratedSample:
    """One sampled continuation.

    ``logprobs[i]`` is the log-probability of ``token_ids[i]`` under the engine's model *before*
    temperature and filtering (the distribution the trainer scores). ``stop_reason`` is ``"stop"``
    (a stop string or token, or EOS; ``token_ids`` keeps the stop token, not text after a stop
    string) or ``"length"`` (``max_tokens`` reached).
    """

    request_id: str
    sample_index: int
    prompt_token_ids: tuple[int, ...] = attrs.field(converter=tuple)
    token_ids: tuple[int, ...] = attrs.field(converter=tuple)
    logprobs: tuple[float, ...] = attrs.field(converter=tuple)
    text: str
    stop_reason: str
    # The policy version that sampled each token (an engine that takes weights while paused stamps
    # them; empty: the engine does not, and the rollout stamps the version it sent the request under).
    token_versions: tuple[int, ...] = attrs.field(default=(), converter=tuple)


# --- environments ------------------------------------------------------------------------------

Message = dict[str, Any]  # {"role": "user" | "assistant" | "system" | "tool", "content": str}


class StepResult(NamedTuple):
    """What ``Environment.step`` returns; unpacks as ``obs, reward, done, info``.

    ``observation`` is the list of messages to append to the conversation (empty when ``done``).
    """

    observation: list[Message]
    reward: float
    done: bool
    info: dict[str, Any]


# --- training ----------------------------------------------------------------------------------


@attrs.frozen(kw_only=True)
class OptimizerHyperparams:
    """AdamW settings for one ``optim_step``, given by the caller instead of the trainer config's
    schedule (the Tinker server passes each request's ``AdamParams``). ``grad_clip`` 0: no clipping."""

    lr: float
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.0
    grad_clip: float = 0.0


@attrs.frozen(kw_only=True)
class TrainingBatch:
    """A batch of sequences in the layout every backend accepts.

    ``input_ids`` is ``[B, P + R]``: prompts left-padded to ``P``, responses right-padded to ``R``;
    ``attention_mask`` marks real tokens. Every ``[B, R]`` tensor is aligned with the response
    tokens ``input_ids[:, P:]``. ``loss_mask`` is 1.0 on trained tokens (0 on padding and on
    environment-written tokens). ``group_ids`` groups samples of one prompt (length ``B``).
    ``position_ids`` ``[B, P + R]`` (optional) marks packed rows (several sequences one after the
    other, as ``skyrl sft`` builds them): positions restart at 0 for every sequence, and a backend
    that scores packed rows (``packed_rows = True``) keeps each sequence's attention inside it.
    """

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    loss_mask: torch.Tensor
    group_ids: tuple[Any, ...] = attrs.field(default=(), converter=tuple)
    advantages: torch.Tensor | None = None
    returns: torch.Tensor | None = None
    old_logprobs: torch.Tensor | None = None
    rollout_logprobs: torch.Tensor | None = None
    ref_logprobs: torch.Tensor | None = None
    values: torch.Tensor | None = None
    token_weights: torch.Tensor | None = None
    # [B, R] long: the policy version that sampled each trained token (-1 on padding and environment tokens).
    token_versions: torch.Tensor | None = None
    position_ids: torch.Tensor | None = None

    @property
    def response_len(self) -> int:
        return int(self.loss_mask.shape[1])

    @property
    def prompt_len(self) -> int:
        return int(self.input_ids.shape[1]) - self.response_len

    def __len__(self) -> int:
        return int(self.input_ids.shape[0])

    def select(self, index: Any) -> TrainingBatch:
        """Rows ``index`` (a slice, list or tensor of row indices) of every tensor field."""
        changes: dict[str, Any] = {}
        for field in attrs.fields(TrainingBatch):
            value = getattr(self, field.name)
            if field.name == "group_ids":
                idx = range(len(self))[index] if isinstance(index, slice) else [int(i) for i in index]
                changes["group_ids"] = tuple(value[i] for i in idx) if value else ()
            elif value is not None:
                changes[field.name] = value[index]
        return TrainingBatch(**changes)

    def split(self, micro_batch_size: int) -> list[TrainingBatch]:
        return [self.select(slice(i, i + micro_batch_size)) for i in range(0, len(self), micro_batch_size)]
