"""What every skyrl-envs environment shares: one episode at a time, turn counting, row access.

An environment is driven as ``messages = env.reset(row)`` then ``env.step(model_text)`` until a
``StepResult`` has ``done=True``. ``observation`` messages are appended to the chat after the
model's turn (role ``user`` by default: every chat template accepts it). Non-final steps give
reward 0; the step that ends the episode carries the episode's reward.
"""

from __future__ import annotations

from typing import Any, ClassVar

from skyrl_core.types import Message, StepResult


class EpisodeEnv:
    """Base class: subclasses set ``options_class`` and implement ``start`` and ``judge``."""

    options_class: ClassVar[type]
    name: ClassVar[str] = "env"

    def __init__(self, **options: Any):
        self.options = self.options_class(**options)
        self.sample: dict[str, Any] | None = None
        self.turn = 0
        self.done = False

    def reset(self, sample: dict[str, Any]) -> list[Message]:
        """Start an episode for dataset row ``sample``; return the prompt messages."""
        if not isinstance(sample, dict):
            raise TypeError(f"{self.name}.reset expects a dataset row (dict), got {type(sample).__name__}")
        self.close()
        self.sample = sample
        self.turn = 0
        self.done = False
        return self.start(sample)

    def step(self, action_text: str) -> StepResult:
        """Judge the model's turn ``action_text``."""
        if self.sample is None:
            raise RuntimeError(f"{self.name}: call reset(sample) before step()")
        if self.done:
            raise RuntimeError(f"{self.name}: the episode is over; call reset(sample) to start another")
        if not isinstance(action_text, str):
            raise TypeError(f"{self.name}.step expects the model's text (str), got {type(action_text).__name__}")
        self.turn += 1
        result = self.judge(action_text)
        if result.done:
            self.done = True
            self.close()
        return result

    def close(self) -> None:
        """Release per-episode resources (connections); called when an episode ends or restarts."""

    # --- for subclasses -------------------------------------------------------------------------

    def start(self, sample: dict[str, Any]) -> list[Message]:
        raise NotImplementedError

    def judge(self, action_text: str) -> StepResult:
        raise NotImplementedError

    def finish(self, reward: float, **info: Any) -> StepResult:
        return StepResult([], float(reward), True, {"turn": self.turn, **info})

    def observe(self, text: str, **info: Any) -> StepResult:
        return StepResult([{"role": "user", "content": text}], 0.0, False, {"turn": self.turn, **info})


def prompt_messages(sample: dict[str, Any], env_name: str) -> list[Message]:
    """The row's ``prompt`` messages (copied), with a clear error when absent."""
    prompt = sample.get("prompt")
    if not isinstance(prompt, list) or not prompt:
        raise ValueError(f"{env_name}: the row needs a 'prompt' list of messages, got {prompt!r:.80}")
    return [dict(message) for message in prompt]


def ground_truth(sample: dict[str, Any], env_name: str) -> Any:
    """``sample["reward_spec"]["ground_truth"]``, with a clear error when absent."""
    spec = sample.get("reward_spec") or {}
    if not isinstance(spec, dict) or spec.get("ground_truth") is None:
        raise ValueError(
            f"{env_name}: the row needs reward_spec.ground_truth, got reward_spec={spec!r:.120}"
        )
    return spec["ground_truth"]
