"""``code``: the model writes a Python program; it runs sandboxed against stdin/stdout tests.

The row's ``reward_spec.ground_truth`` is ``{"tests": [{"input": "...", "output": "..."}, ...]}``.
The program is the last fenced block of the model's text (```` ```python ```` preferred, any
```` ``` ```` block otherwise; an unclosed last fence runs to the end of the text). Each test runs
the program in a fresh sandbox (``skyrl_envs.sandbox``) with the test's input on stdin; a test
passes when the program exits 0 within its limits and its stdout equals the expected output up
to trailing whitespace on each line and trailing blank lines. Reward: the fraction of tests
passed (0.0 when there is no code block).

Single turn by default. With ``max_turns > 1`` a program that fails a test is told so and may try
again; the last attempt's fraction is the reward. What it is told is the ``feedback`` option:
``pass_count`` (default: how many tests passed), ``none`` (only that some failed) or
``first_failure`` (the first failing test's input, expected output and the program's output; a
policy shown expected outputs can learn to print them, so this leaks the hidden tests).

The sandbox refuses to run where this machine cannot isolate the program (``SandboxUnavailable``
is raised, never swallowed into a reward). A program the sandbox cannot hold (not valid UTF-8,
larger than ``disk_bytes``) fails every test with the outcome ``rejected`` and the reason in info.
"""

from __future__ import annotations

import re
from typing import Any

import attrs

from skyrl_core.types import Message, StepResult
from skyrl_envs.base import EpisodeEnv, ground_truth, prompt_messages
from skyrl_envs.sandbox.limits import SandboxLimits

_FENCE = re.compile(r"```[ \t]*([A-Za-z0-9_+-]*)[^\n]*\n(.*?)(?:```|\Z)", re.DOTALL)
_FEEDBACK_CHARS = 300
FEEDBACK_KINDS = ("none", "pass_count", "first_failure")


def _limits(value: Any) -> SandboxLimits:
    return SandboxLimits(**value) if isinstance(value, dict) else value


def _check_turns(instance: Any, attribute: attrs.Attribute, value: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"code option max_turns must be an integer >= 1, got {value!r}")


def _check_feedback(instance: Any, attribute: attrs.Attribute, value: str) -> None:
    if value not in FEEDBACK_KINDS:
        raise ValueError(f"code option feedback must be one of {', '.join(FEEDBACK_KINDS)}, got {value!r}")


@attrs.frozen(kw_only=True)
class CodeOptions:
    max_turns: int = attrs.field(default=1, validator=_check_turns,
                                 metadata={"help": "1 = single turn; more = retry after seeing a failing test"})
    sandbox: SandboxLimits = attrs.field(factory=SandboxLimits, converter=_limits,
                                         metadata={"help": "limits of each test run (see SandboxLimits)"})
    stop_at_first_failure: bool = attrs.field(default=False,
                                              metadata={"help": "skip the remaining tests after a failure"})
    feedback: str = attrs.field(default="pass_count", validator=_check_feedback,
                                metadata={"help": "what a retry is told (max_turns > 1): none, pass_count, or "
                                                  "first_failure (shows the expected output: leaks the tests)"})


def extract_program(text: str) -> str | None:
    """The last ```` ```python ```` block of ``text``, else its last fenced block, else None."""
    blocks = _FENCE.findall(text)
    if not blocks:
        return None
    python_blocks = [code for language, code in blocks if language.lower() in ("python", "py", "python3")]
    program = (python_blocks or [code for _, code in blocks])[-1]
    return program if program.strip() else None


def outputs_match(actual: str, expected: str) -> bool:
    """Equal up to trailing whitespace on each line and trailing blank lines."""
    def canonical(text: str) -> list[str]:
        lines = [line.rstrip() for line in text.replace("\r\n", "\n").split("\n")]
        while lines and not lines[-1]:
            lines.pop()
        return lines
    return canonical(actual) == canonical(expected)


def _check_tests(tests: Any) -> list[dict[str, str]]:
    if not isinstance(tests, list) or not tests:
        raise ValueError(f"code: reward_spec.ground_truth.tests must be a non-empty list, got {tests!r:.120}")
    for number, test in enumerate(tests):
        if not (isinstance(test, dict) and isinstance(test.get("input"), str) and isinstance(test.get("output"), str)):
            raise ValueError(f"code: test {number} must be {{'input': str, 'output': str}}, got {test!r:.120}")
    return tests


class CodeEnv(EpisodeEnv):
    options_class = CodeOptions
    name = "code"

    def start(self, sample: dict[str, Any]) -> list[Message]:
        truth = ground_truth(sample, self.name)
        self._tests = _check_tests(truth.get("tests") if isinstance(truth, dict) else None)
        return prompt_messages(sample, self.name)

    def judge(self, action_text: str) -> StepResult:
        from skyrl_envs.sandbox.runner import run_python

        program = extract_program(action_text)
        if program is None:
            if self.turn < self.options.max_turns:
                return self.observe("No code block found. Put your program in a ```python fenced block.",
                                    reason="no_code", passed=0, total=len(self._tests))
            return self.finish(0.0, reason="no_code", passed=0, total=len(self._tests))
        passed, outcomes, first_failure = 0, [], None
        for test in self._tests:
            result = run_python(program, test["input"], self.options.sandbox)
            if result.rejected:  # the same program fails every test the same way
                outcomes += ["rejected"] * (len(self._tests) - len(outcomes))
                first_failure = first_failure or (test, result)
                break
            ok = result.ok and outputs_match(result.stdout, test["output"])
            passed += ok
            outcomes.append(_outcome(result, ok))
            if not ok and first_failure is None:
                first_failure = (test, result)
                if self.options.stop_at_first_failure:
                    break
        reward = passed / len(self._tests)
        info = {"passed": passed, "total": len(self._tests), "outcomes": outcomes}
        if first_failure is not None and first_failure[1].rejected:
            info["rejected"] = first_failure[1].rejected
        if first_failure is None or self.turn >= self.options.max_turns:
            return self.finish(reward, reason="graded", **info)
        return self.observe(self._feedback(passed, *first_failure), reason="retry", **info)

    def _feedback(self, passed: int, test: dict[str, str], result: Any) -> str:
        again = "Fix the program and answer with a new ```python block."
        if result.rejected:
            return f"Your program could not be run: {result.rejected}.\n{again}"
        if self.options.feedback == "first_failure":
            return _first_failure_feedback(test, result)
        if self.options.feedback == "pass_count":
            return f"Your program failed: {passed} of {len(self._tests)} tests passed.\n{again}"
        return f"Your program failed at least one test.\n{again}"


def _outcome(result: Any, ok: bool) -> str:
    if ok:
        return "passed"
    if result.timed_out:
        return "timeout"
    if result.output_truncated:
        return "output_limit"
    if result.signal is not None:
        return f"signal_{result.signal}"
    if result.exit_code != 0:
        return f"exit_{result.exit_code}"
    return "wrong_output"


def _first_failure_feedback(test: dict[str, str], result: Any) -> str:
    cut = _FEEDBACK_CHARS
    if result.timed_out:
        got = "(the program ran out of time)"
    elif result.exit_code != 0:
        got = f"(the program failed)\n{result.stderr[-cut:]}"
    else:
        got = result.stdout[:cut]
    return (f"Your program failed a test.\nInput:\n{test['input'][:cut]}\nExpected output:\n{test['output'][:cut]}\n"
            f"Your output:\n{got}\nFix the program and answer with a new ```python block.")
