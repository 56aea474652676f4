"""``multi_tool``: each turn the model picks a tool, ``<search>`` or ``<python>``, or answers.

``<search>query</search>`` shows the best passages of the local index (as in ``search``);
``<python>code</python>`` runs the code in the sandbox (as in ``code``; a fenced block inside
the tags is unwrapped) and shows its stdout, or its error. The sandbox shows the program only the
system libraries and the standard library, so it cannot read the shipped answer key. ``<answer>text</answer>`` ends the
episode: reward 1.0 when the answer equals one of ``reward_spec.ground_truth`` (a string, a
list, or ``{"target": ...}``): numerically when both are numbers (``632`` = ``632.0``),
otherwise after SQuAD normalisation; else 0.0. After ``max_turns`` turns, reward 0.0.
"""

from __future__ import annotations

from typing import Any

import attrs

from skyrl_core.tools import Tool
from skyrl_envs.code_env import extract_program
from skyrl_envs.math_answers import as_number
from skyrl_envs.qa import exact_match
from skyrl_envs.sandbox.limits import SandboxLimits
from skyrl_envs.search_env import SearchEnv, question_rows
from skyrl_envs.search_index import SHIPPED_CORPUS

INSTRUCTIONS = (
    "Answer the question. You have two tools: write <search>your query</search> to search a document "
    "collection, or <python>code</python> to run a Python program and see what it prints. Use one tool per "
    "turn. When you know the answer, write it as <answer>...</answer>."
)

MULTI_TOOL_QUESTIONS = [
    ("What is the atomic number of gold multiplied by the atomic number of oxygen?", ["632"]),
    ("What is the sum of the atomic numbers of iron, carbon and helium?", ["34"]),
    ("How many Earth days do 10 years on Mercury last?", ["880"]),
    ("By how many metres is Mount Everest taller than Kilimanjaro?", ["2954"]),
    ("How many years after the World Wide Web was invented was Python first released?", ["2"]),
    ("What is the number of squares on a chessboard times the number of chambers of the human heart?", ["256"]),
]
_OBSERVATION_CHARS = 2000


def _positive(instance: Any, attribute: attrs.Attribute, value: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"multi_tool option {attribute.name} must be a positive integer, got {value!r}")


def _limits(value: Any) -> SandboxLimits:
    return SandboxLimits(**value) if isinstance(value, dict) else value


@attrs.frozen(kw_only=True)
class MultiToolOptions:
    corpus_path: str = attrs.field(default=str(SHIPPED_CORPUS), metadata={"help": "JSONL corpus for <search>", "path": "input"})
    index_dir: str = attrs.field(default="", metadata={"help": "where the index is built ('' = $SKYRL_CACHE_DIR/search)", "path": "output"})
    top_k: int = attrs.field(default=3, validator=_positive, metadata={"help": "passages returned per search"})
    max_passage_chars: int = attrs.field(default=600, validator=_positive, metadata={"help": "passages are cut to this"})
    max_turns: int = attrs.field(default=6, validator=_positive, metadata={"help": "turns before the episode ends"})
    sandbox: SandboxLimits = attrs.field(factory=SandboxLimits, converter=_limits,
                                         metadata={"help": "limits of each <python> run"})


def answers_agree(predicted: str, answers: list[str]) -> bool:
    """Numeric equality when both sides are numbers, else normalised exact match."""
    number = as_number(predicted)
    if number is not None and any(as_number(a) == number for a in answers):
        return True
    return exact_match(predicted, answers)


def multi_tool_rows() -> list[dict[str, Any]]:
    """The shipped search-then-compute questions as ``multi_tool`` dataset rows."""
    return question_rows(MULTI_TOOL_QUESTIONS, INSTRUCTIONS, "multi_tool")


class MultiToolEnv(SearchEnv):
    """``search`` with a ``<python>`` tool, and answers that also agree as numbers."""

    options_class = MultiToolOptions
    name = "multi_tool"
    no_tool_call = ("No tool call or answer found. Use <search>...</search>, <python>...</python> "
                    "or <answer>...</answer>.")

    def tools(self) -> list[Tool]:
        return [*super().tools(),
                Tool(name="python", description="run a Python program and see what it prints", run=self._run_python)]

    def is_correct(self, predicted: str) -> bool:
        return answers_agree(predicted, self._answers)

    def _run_python(self, code: str) -> str:
        from skyrl_envs.sandbox.runner import run_python

        program = extract_program(code) or code
        result = run_python(program, "", self.options.sandbox)
        if result.rejected:
            return f"Error: the program could not be run: {result.rejected}."
        if result.timed_out:
            return "Error: the program ran out of time."
        output = result.stdout[:_OBSERVATION_CHARS]
        if result.exit_code != 0:
            return f"{output}\nError (exit {result.exit_code}, signal {result.signal}):\n{result.stderr[-_OBSERVATION_CHARS:]}"
        return output if output.strip() else "(the program printed nothing)"
