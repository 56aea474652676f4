"""What a rollout produces, and how it becomes a ``TrainingBatch``.

A ``Trajectory`` is one episode: the prompt's token ids, then a list of ``Segment``s, alternating
model turns (trained, with the engine's logprobs) and environment turns (observations and the
template's turn endings: never trained). Training samples are cut from it either whole (one
sample per episode, environment tokens masked out) or step-wise (one sample per model turn, its
prompt being everything before that turn).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Sequence

import attrs

from skyrl_core.types import Message, TrainingBatch

if TYPE_CHECKING:
    import torch


@attrs.frozen(kw_only=True)
class Segment:
    """Consecutive response tokens written by the model (``trained``) or by the environment."""

    token_ids: tuple[int, ...] = attrs.field(converter=tuple)
    logprobs: tuple[float, ...] = attrs.field(converter=tuple)
    trained: bool
    # The policy version that sampled each token (model turns); environment tokens have none (-1).
    versions: tuple[int, ...] = attrs.field(default=(), converter=tuple)

    def __attrs_post_init__(self) -> None:
        if len(self.token_ids) != len(self.logprobs):
            raise ValueError(f"segment has {len(self.token_ids)} tokens but {len(self.logprobs)} logprobs")
        if self.versions and len(self.versions) != len(self.token_ids):
            raise ValueError(f"segment has {len(self.token_ids)} tokens but {len(self.versions)} versions")

    def token_versions(self) -> tuple[int, ...]:
        return self.versions if self.versions and self.trained else (-1,) * len(self.token_ids)


@attrs.define(kw_only=True)
class Trajectory:
    """One episode of one prompt.

    ``reward`` is the sum of the environment's step rewards; ``correct`` is the last step's
    ``info["correct"]`` when the environment reports it, else ``reward >= 1``. ``stop_reason`` is
    the engine's for the last model turn (``"stop"``/``"length"``), or ``"max_turns"`` /
    ``"max_response_tokens"`` when the loop cut the episode short.
    """

    group_id: str
    trajectory_id: str
    prompt_ids: list[int]
    segments: list[Segment] = attrs.field(factory=list)
    messages: list[Message] = attrs.field(factory=list)
    step_rewards: list[float] = attrs.field(factory=list)
    correct: bool = False
    stop_reason: str = "stop"
    info: dict[str, Any] = attrs.field(factory=dict)

    @property
    def reward(self) -> float:
        return float(sum(self.step_rewards))

    @property
    def num_turns(self) -> int:
        return sum(1 for s in self.segments if s.trained)

    @property
    def response_ids(self) -> list[int]:
        return [t for s in self.segments for t in s.token_ids]

    @property
    def token_versions(self) -> list[int]:
        """The policy version of every response token (-1: written by the environment)."""
        return [v for s in self.segments for v in s.token_versions()]

    @property
    def versions(self) -> set[int]:
        """The policy versions that sampled this episode's tokens."""
        return {v for v in self.token_versions if v >= 0}

    @property
    def model_token_count(self) -> int:
        return sum(len(s.token_ids) for s in self.segments if s.trained)

    def as_sample(self) -> TrainingSample:
        """The whole episode as one sample; environment tokens have loss mask 0."""
        ids, mask, logprobs = [], [], []
        for seg in self.segments:
            ids.extend(seg.token_ids)
            mask.extend([1.0 if seg.trained else 0.0] * len(seg.token_ids))
            logprobs.extend(seg.logprobs if seg.trained else [0.0] * len(seg.token_ids))
        return TrainingSample(
            prompt_ids=tuple(self.prompt_ids), response_ids=tuple(ids), loss_mask=tuple(mask),
            logprobs=tuple(logprobs), reward=self.reward, group_id=self.group_id,
            trajectory_id=self.trajectory_id, is_last_step=True, versions=tuple(self.token_versions),
        )

    def step_samples(self) -> list[TrainingSample]:
        """One sample per model turn: prompt = everything before the turn, response = the turn.

        Every step carries the episode's reward; the trainer computes advantages on the last step
        of each episode and gives them to the episode's other steps.
        """
        samples: list[TrainingSample] = []
        context = list(self.prompt_ids)
        trained = [i for i, s in enumerate(self.segments) if s.trained]
        for i, seg in enumerate(self.segments):
            if seg.trained:
                samples.append(TrainingSample(
                    prompt_ids=tuple(context), response_ids=seg.token_ids, loss_mask=(1.0,) * len(seg.token_ids),
                    logprobs=seg.logprobs, reward=self.reward, group_id=self.group_id,
                    trajectory_id=self.trajectory_id, is_last_step=i == trained[-1], versions=seg.token_versions(),
                ))
            context.extend(seg.token_ids)
        return samples


@attrs.frozen(kw_only=True)
class TrainingSample:
    """One row of a training batch, before padding."""

    prompt_ids: tuple[int, ...]
    response_ids: tuple[int, ...]
    loss_mask: tuple[float, ...]
    logprobs: tuple[float, ...]
    reward: float
    group_id: str
    trajectory_id: str
    is_last_step: bool
    versions: tuple[int, ...] = ()  # per response token; -1 on environment tokens


def training_samples(trajectories: Sequence[Trajectory], *, stepwise: bool) -> list[TrainingSample]:
    if stepwise:
        return [s for t in trajectories for s in t.step_samples()]
    return [t.as_sample() for t in trajectories]


def build_training_batch(samples: Sequence[TrainingSample], pad_token_id: int) -> TrainingBatch:
    """Left-pad prompts and right-pad responses into a ``TrainingBatch`` (with ``rollout_logprobs``
    and ``token_versions``: -1 on padding, environment tokens and samples that carry no versions).

    A response of zero tokens (an engine that stopped at once) still gets one column, fully masked.
    """
    import torch

    if not samples:
        raise ValueError("cannot build a training batch from zero samples")
    P = max(len(s.prompt_ids) for s in samples)
    R = max(1, max(len(s.response_ids) for s in samples))
    B = len(samples)
    input_ids = torch.full((B, P + R), pad_token_id, dtype=torch.long)
    attention = torch.zeros((B, P + R), dtype=torch.long)
    loss_mask = torch.zeros((B, R), dtype=torch.float32)
    logprobs = torch.zeros((B, R), dtype=torch.float32)
    versions = torch.full((B, R), -1, dtype=torch.long)
    for row, s in enumerate(samples):
        p, r = len(s.prompt_ids), len(s.response_ids)
        input_ids[row, P - p:P] = torch.tensor(s.prompt_ids, dtype=torch.long)
        attention[row, P - p:P] = 1
        if r:
            input_ids[row, P:P + r] = torch.tensor(s.response_ids, dtype=torch.long)
            attention[row, P:P + r] = 1
            loss_mask[row, :r] = torch.tensor(s.loss_mask, dtype=torch.float32)
            logprobs[row, :r] = torch.tensor(s.logprobs, dtype=torch.float32)
            if s.versions:
                versions[row, :r] = torch.tensor(s.versions, dtype=torch.long)
    return TrainingBatch(
        input_ids=input_ids, attention_mask=attention, loss_mask=loss_mask,
        group_ids=tuple(s.group_id for s in samples), rollout_logprobs=logprobs, token_versions=versions,
    )


def token_rewards(samples: Sequence[TrainingSample], loss_mask: torch.Tensor) -> torch.Tensor:
    """``[B, R]`` with each sample's scalar reward on its last trained token (0 elsewhere)."""
    import torch

    rewards = torch.zeros_like(loss_mask)
    for row, s in enumerate(samples):
        trained = torch.nonzero(loss_mask[row] > 0).flatten()
        if len(trained):
            rewards[row, int(trained[-1])] = s.reward
    return rewards
