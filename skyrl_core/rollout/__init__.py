"""Rollouts: prompts through the chat template, episodes through engines and environments,
trajectories into training batches, token-in/token-out throughout."""

from skyrl_core.rollout.agent_loop import EnvironmentFactory, RolloutError, RolloutGenerator, Sampling, request_seed
from skyrl_core.rollout.chat import ChatCodec, ChatTemplateError
from skyrl_core.rollout.trajectory import (
    Segment,
    TrainingSample,
    Trajectory,
    build_training_batch,
    token_rewards,
    training_samples,
)

__all__ = [
    "ChatCodec",
    "ChatTemplateError",
    "EnvironmentFactory",
    "RolloutError",
    "RolloutGenerator",
    "Sampling",
    "Segment",
    "TrainingSample",
    "Trajectory",
    "build_training_batch",
    "request_seed",
    "token_rewards",
    "training_samples",
]
