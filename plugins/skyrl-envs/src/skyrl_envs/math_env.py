"""``gsm8k`` and ``math``: word problems judged on the final answer.

The row's ``reward_spec.ground_truth`` is the answer (``"72"``, ``"\\frac{1}{2}"``) or a worked
solution ending in ``#### 72`` or ``\\boxed{...}``. The model's answer is looked for in the
formats of ``answer_formats`` in order (GSM8K: ``#### x`` first; MATH: ``\\boxed{x}`` first;
``strict=True`` keeps only the first format, so an answer in another format scores 0).

Single turn by default. With ``max_turns > 1`` a wrong or missing answer gets feedback and
another try; the episode ends at the first right answer (reward 1) or after ``max_turns``
(reward 0).
"""

from __future__ import annotations

from typing import Any

import attrs

from skyrl_core.types import Message, StepResult
from skyrl_envs.base import EpisodeEnv, ground_truth, prompt_messages
from skyrl_envs.math_answers import answers_match, extract_answer, gold_answer

FORMATS = ("hash", "boxed", "last_number")
CHECKERS = ("auto", "math_verify", "sympy")
FORMAT_HINT = {"hash": "End with '#### <answer>'.", "boxed": "Put the final answer in \\boxed{}.",
               "last_number": "End with the final number."}


def _check_formats(instance: Any, attribute: attrs.Attribute, value: tuple[str, ...]) -> None:
    bad = [f for f in value if f not in FORMATS]
    if not value or bad:
        raise ValueError(f"answer_formats must be a non-empty list from {list(FORMATS)}, got {list(value)}")


def _check_checker(instance: Any, attribute: attrs.Attribute, value: str) -> None:
    if value not in CHECKERS:
        raise ValueError(f"checker must be one of {list(CHECKERS)}, got {value!r}")


def _check_turns(instance: Any, attribute: attrs.Attribute, value: int) -> None:
    if not isinstance(value, int) or value < 1:
        raise ValueError(f"max_turns must be an integer >= 1, got {value!r}")


@attrs.frozen(kw_only=True)
class MathOptions:
    answer_formats: tuple[str, ...] = attrs.field(
        default=("boxed", "hash", "last_number"), converter=tuple, validator=_check_formats,
        metadata={"help": "where to look for the model's answer, in order: hash, boxed, last_number"})
    strict: bool = attrs.field(default=False, metadata={"help": "accept only the first answer format"})
    checker: str = attrs.field(default="auto", validator=_check_checker,
                               metadata={"help": "equivalence: auto (math-verify if installed, else sympy), math_verify, sympy"})
    max_turns: int = attrs.field(default=1, validator=_check_turns,
                                 metadata={"help": "1 = single turn; more = retry with feedback after a wrong answer"})


@attrs.frozen(kw_only=True)
class GSM8KOptions(MathOptions):
    answer_formats: tuple[str, ...] = attrs.field(
        default=("hash", "boxed", "last_number"), converter=tuple, validator=_check_formats,
        metadata={"help": "where to look for the model's answer, in order: hash, boxed, last_number"})


class MathEnv(EpisodeEnv):
    """Reward 1.0 when the extracted answer equals the ground truth, else 0.0."""

    options_class = MathOptions
    name = "math"

    def start(self, sample: dict[str, Any]) -> list[Message]:
        self._gold = gold_answer(ground_truth(sample, self.name))
        return prompt_messages(sample, self.name)

    def judge(self, action_text: str) -> StepResult:
        formats = self.options.answer_formats[:1] if self.options.strict else self.options.answer_formats
        parsed = extract_answer(action_text, formats)
        correct = answers_match(parsed, self._gold, checker=self.options.checker)
        info = {"parsed": parsed, "gold": self._gold}
        if correct or self.turn >= self.options.max_turns:
            return self.finish(1.0 if correct else 0.0, **info)
        if parsed is None:
            feedback = f"I could not find a final answer. {FORMAT_HINT[formats[0]]} Try again."
        else:
            feedback = f"Your answer {parsed} is not correct. Try again. {FORMAT_HINT[formats[0]]}"
        return self.observe(feedback, **info)


class GSM8KEnv(MathEnv):
    """``math`` with GSM8K's ``#### x`` answer format looked for first."""

    options_class = GSM8KOptions
    name = "gsm8k"
