"""``arithmetic``: "What is 12 + 34?" with a 1/0 reward for the right integer.

The task small instruct models can visibly learn in minutes on a CPU (the quickstart demo
trains SmolLM2-135M-Instruct on it). The answer parsed from the model's text is the content of
the last ``\\boxed{...}`` when there is one, else the last integer in the text (``1,234`` counts
as 1234); the reward is 1.0 when it equals the ground truth, else 0.0.

Rows come from ``arithmetic_rows`` / ``write_arithmetic_splits`` (deterministic, seeded, train and
eval disjoint), from any dataset with ``reward_spec.ground_truth``, or are made up by the
environment itself when ``reset`` gets a row without a ``prompt``: from the row's
``extra_info`` ``a``/``b``/``op`` when present, else drawn at random from a generator seeded by
``seed``, the row's content and the number of episodes this instance has run. So fresh
instances given one row agree on its problem (the episodes of a GRPO group must), different
rows (``{"extra_info": {"index": 7}}``) get different problems, and an instance reset again
with the same row moves on to a new one.
"""

from __future__ import annotations

import json
import random
import re
from pathlib import Path
from typing import Any

import attrs

from skyrl_core.types import Message, StepResult
from skyrl_envs.base import EpisodeEnv, ground_truth, prompt_messages

OPERATIONS = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b}
INSTRUCTION = "Answer with just the number."
_INTEGER = re.compile(r"-?\d{1,3}(?:,\d{3})+(?!\d)|-?\d+")
_BOXED = re.compile(r"\\boxed\{\s*([^{}]*?)\s*\}")


def _check_operations(instance: Any, attribute: attrs.Attribute, value: tuple[str, ...]) -> None:
    bad = [op for op in value if op not in OPERATIONS]
    if not value or bad:
        raise ValueError(f"arithmetic operations must be a non-empty subset of {sorted(OPERATIONS)}, got {list(value)}")


def _check_range(instance: "ArithmeticOptions", attribute: attrs.Attribute, value: int) -> None:
    if instance.min_operand > value:
        raise ValueError(f"arithmetic max_operand ({value}) must be >= min_operand ({instance.min_operand})")


@attrs.frozen(kw_only=True)
class ArithmeticOptions:
    min_operand: int = attrs.field(default=0, metadata={"help": "smallest operand of generated problems"})
    max_operand: int = attrs.field(default=49, validator=_check_range,
                                   metadata={"help": "largest operand of generated problems"})
    operations: tuple[str, ...] = attrs.field(default=("+",), converter=tuple, validator=_check_operations,
                                              metadata={"help": "operators to draw from: +, -, *"})
    seed: int = attrs.field(default=0, metadata={"help": "seed of problems made up for rows without a prompt or operands"})


def parse_integer_answer(text: str) -> int | None:
    """The last ``\\boxed{}`` integer when there is a box, else the last integer; None if none."""
    boxes = _BOXED.findall(text)
    candidates = _INTEGER.findall(boxes[-1]) if boxes else _INTEGER.findall(text)
    if not candidates:
        return None
    try:
        return int(candidates[-1].replace(",", ""))
    except ValueError:  # past Python's digit limit (4300): no answer a problem here could have
        return None


def problem_row(a: int, b: int, op: str, **extra_info: Any) -> dict[str, Any]:
    """One dataset row asking ``a op b``."""
    answer = OPERATIONS[op](a, b)
    return {
        "prompt": [{"role": "user", "content": f"What is {a} {op} {b}? {INSTRUCTION}"}],
        "env_class": "arithmetic",
        "reward_spec": {"ground_truth": str(answer)},
        "extra_info": {"a": a, "b": b, "op": op, **extra_info},
    }


def arithmetic_rows(train_size: int, eval_size: int, *, seed: int = 0,
                    options: ArithmeticOptions = ArithmeticOptions()) -> tuple[list[dict], list[dict]]:
    """Deterministic ``(train, eval)`` rows: every distinct problem at most once across both."""
    problems = [(a, b, op) for op in options.operations
                for a in range(options.min_operand, options.max_operand + 1)
                for b in range(options.min_operand, options.max_operand + 1)]
    if train_size + eval_size > len(problems):
        raise ValueError(
            f"asked for {train_size} train + {eval_size} eval problems but the options allow only "
            f"{len(problems)} distinct ones; widen the operand range or add operations"
        )
    random.Random(seed).shuffle(problems)
    held_out = [problem_row(a, b, op, split="eval", index=i) for i, (a, b, op) in enumerate(problems[:eval_size])]
    train = [problem_row(a, b, op, split="train", index=i)
             for i, (a, b, op) in enumerate(problems[eval_size:eval_size + train_size])]
    return train, held_out


def write_arithmetic_splits(out_dir: str | Path, train_size: int = 2000, eval_size: int = 200, *,
                            seed: int = 0, options: ArithmeticOptions = ArithmeticOptions()) -> dict[str, Path]:
    """Write ``train.jsonl`` and ``eval.jsonl`` under ``out_dir``; return their paths."""
    from skyrl_core.data import write_jsonl

    train, held_out = arithmetic_rows(train_size, eval_size, seed=seed, options=options)
    out_dir = Path(out_dir)
    return {"train": write_jsonl(train, out_dir / "train.jsonl"), "eval": write_jsonl(held_out, out_dir / "eval.jsonl")}


class ArithmeticEnv(EpisodeEnv):
    """Single turn: the first step ends the episode with reward 1.0 (right integer) or 0.0."""

    options_class = ArithmeticOptions
    name = "arithmetic"

    def __init__(self, **options: Any):
        super().__init__(**options)
        self._episodes = 0
        self._answer: int | None = None

    def start(self, sample: dict[str, Any]) -> list[Message]:
        if sample.get("prompt"):
            truth = ground_truth(sample, self.name)
            try:
                self._answer = int(str(truth).replace(",", "").strip())
            except ValueError:
                raise ValueError(f"arithmetic: reward_spec.ground_truth must be an integer, got {truth!r}") from None
            return prompt_messages(sample, self.name)
        info = sample.get("extra_info") or {}
        if {"a", "b", "op"} <= set(info):
            row = problem_row(int(info["a"]), int(info["b"]), info["op"])
        else:
            opts = self.options
            rng = random.Random(f"{opts.seed}:{json.dumps(sample, sort_keys=True, default=str)}:{self._episodes}")
            row = problem_row(rng.randint(opts.min_operand, opts.max_operand),
                              rng.randint(opts.min_operand, opts.max_operand), rng.choice(opts.operations))
        self._episodes += 1
        self.sample = {**sample, **row}  # the episode's row records the problem it made up
        self._answer = int(row["reward_spec"]["ground_truth"])
        return prompt_messages(row, self.name)

    def judge(self, action_text: str) -> StepResult:
        parsed = parse_integer_answer(action_text)
        return self.finish(1.0 if parsed == self._answer else 0.0, parsed=parsed, answer=self._answer)
