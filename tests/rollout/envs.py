"""Small environments for rollout and end-to-end tests, registered by hand on a plugin manager."""

from __future__ import annotations

from typing import Any

from skyrl_core.plugins import hookimpl
from skyrl_core.plugins.records import EnvironmentSpec
from skyrl_core.tools import Tool, ToolBox
from skyrl_core.types import StepResult

TINY_QWEN3 = {
    "model_type": "qwen3", "vocab_size": 512, "hidden_size": 64, "intermediate_size": 128,
    "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32,
    "max_position_embeddings": 512, "tie_word_embeddings": True,
}


class DigitsEnv:
    """Single turn; reward = share of the response's characters that are digits.

    A random tiny byte-level model writes a digit about 2% of the time, so the reward is dense
    and varies within a group: GRPO raises it within a few steps. ``correct`` = reward >= 0.5.
    """

    def reset(self, sample: dict[str, Any]) -> list[dict[str, str]]:
        return [dict(m) for m in sample["prompt"]]

    def step(self, action_text: str) -> StepResult:
        reward = sum(c.isdigit() for c in action_text) / max(1, len(action_text))
        return StepResult([], reward, True, {"correct": reward >= 0.5})


class CounterToolEnv:
    """Multi-turn with a tool: each turn the model may call ``<count>text</count>`` (the tool
    answers with the length of ``text``); otherwise it is told which tools exist. The episode ends
    after ``turns`` model turns with reward 1.0 when the last turn is longer than 4 characters."""

    def __init__(self, turns: int = 3) -> None:
        self.turns = turns
        self.tools = ToolBox([Tool(name="count", description="count characters", run=lambda arg: str(len(arg)))])

    def reset(self, sample: dict[str, Any]) -> list[dict[str, str]]:
        self.turn = 0
        return [{"role": "system", "content": "Tools:\n" + self.tools.describe()}, *sample["prompt"]]

    def step(self, action_text: str) -> StepResult:
        self.turn += 1
        if self.turn >= self.turns:
            return StepResult([], float(len(action_text) > 4), True, {})
        call = self.tools.first_call(action_text)
        text = self.tools.execute(call) if call else "No tool call. " + self.tools.describe()
        return StepResult([{"role": "user", "content": f"Observation {self.turn}: {text}"}], 0.0, False, {})


class TestEnvironments:
    """A plugin object registering the test environments."""

    @hookimpl
    def skyrl_register_environments(self, register) -> None:
        register(EnvironmentSpec(name="digits", factory="tests.rollout.envs:DigitsEnv"))
        register(EnvironmentSpec(name="counter_tool", factory="tests.rollout.envs:CounterToolEnv"))


def prompt_rows(count: int, env_class: str) -> list[dict[str, Any]]:
    return [{"prompt": [{"role": "user", "content": f"Task {i}: write something."}], "env_class": env_class,
             "reward_spec": {}, "extra_info": {}} for i in range(count)]
