import pytest

import skyrl_core
from skyrl_envs.code_env import CodeEnv, extract_program, outputs_match
from skyrl_envs.sandbox import SandboxLimits

SUM_ROW = {
    "prompt": [{"role": "user", "content": "Read two integers and print their sum."}],
    "env_class": "code",
    "reward_spec": {"ground_truth": {"tests": [
        {"input": "1 2\n", "output": "3\n"},
        {"input": "10 -4\n", "output": "6\n"},
        {"input": "0 0\n", "output": "0"},
        {"input": "5 5\n", "output": "10\n"},
    ]}},
}
# A correct program gets ample wall time (a loaded machine can take seconds to start Python: a
# 1 s limit failed a right answer once); a runaway one is stopped by its 1 s of CPU.
FAST = {"sandbox": {"wall_seconds": 20.0, "cpu_seconds": 1}}


def answer(code):
    return f"Here is my solution:\n```python\n{code}\n```\nIt reads the input."


def test_make_env_reset_step_exactly_as_documented():
    env = skyrl_core.make_env("code")
    assert env.reset(SUM_ROW) == SUM_ROW["prompt"]
    result = env.step(answer("a, b = map(int, input().split())\nprint(a + b)"))
    assert (result.reward, result.done, result.observation) == (1.0, True, [])
    assert result.info["passed"] == 4 and result.info["outcomes"] == ["passed"] * 4


@pytest.mark.parametrize("text, reward, outcome", [
    (answer("a, b = map(int, input().split())\nprint(a + b if a != 10 else 0)"), 0.75, "wrong_output"),  # partly right
    (answer("print(3)"), 0.25, "wrong_output"),                                                         # wrong
    (answer("a, b = map(int, input().split())\nprint(a - b)"), 0.25, "wrong_output"),                   # 0 0 passes
    (answer("print(("), 0.0, "exit_1"),                                                                 # syntax error
    (answer("while True: pass"), 0.0, "signal_24"),                                                      # no end
    ("a, b = map(int, input().split())\nprint(a + b)", 0.0, None),                                      # malformed: no fence
])
def test_reward_is_the_fraction_of_tests_passed(text, reward, outcome):
    env = CodeEnv(stop_at_first_failure=reward == 0.0, **FAST)  # a program that fails all: one run is enough
    env.reset(SUM_ROW)
    result = env.step(text)
    assert (result.reward, result.done) == (reward, True)
    if outcome is None:
        assert result.info["reason"] == "no_code"
    else:
        assert outcome in result.info["outcomes"] or (outcome == "signal_24" and "timeout" in result.info["outcomes"])


def test_stop_at_first_failure_skips_the_rest():
    env = CodeEnv(stop_at_first_failure=True, **FAST)
    env.reset(SUM_ROW)
    result = env.step(answer("print(3)"))
    assert result.info["outcomes"] == ["passed", "wrong_output"] and result.reward == 0.25


def test_multi_turn_shows_the_failing_test_and_grades_the_retry():
    env = CodeEnv(max_turns=2, feedback="first_failure", **FAST)
    env.reset(SUM_ROW)
    first = env.step(answer("print(3)"))
    feedback = first.observation[0]["content"]
    assert not first.done and first.reward == 0.0
    assert "Input:\n10 -4" in feedback and "Expected output:\n6" in feedback and "Your output:\n3" in feedback
    second = env.step(answer("a, b = map(int, input().split())\nprint(a + b)"))
    assert (second.reward, second.done) == (1.0, True)


def test_program_extraction_and_output_comparison():
    assert extract_program("```python\nprint(1)\n```\n```python\nprint(2)\n```") == "print(2)\n"
    assert extract_program("```\nprint(1)\n```") == "print(1)\n"
    assert extract_program("```bash\nls\n```\n```py\nprint(3)\n```") == "print(3)\n"
    assert extract_program("text\n```python\nprint(4)") == "print(4)"  # unclosed last fence
    assert extract_program("no code") is None and extract_program("```python\n\n```") is None
    assert outputs_match("3  \n\n", "3") and outputs_match("a\r\nb\n", "a\nb")
    assert not outputs_match("3 4", "34") and not outputs_match("\n3", "3")


def test_bad_rows_and_options_are_refused():
    with pytest.raises(ValueError, match="non-empty list"):
        CodeEnv().reset({**SUM_ROW, "reward_spec": {"ground_truth": {"tests": []}}})
    with pytest.raises(ValueError, match="test 0 must be"):
        CodeEnv().reset({**SUM_ROW, "reward_spec": {"ground_truth": {"tests": [{"input": 1, "output": "2"}]}}})
    with pytest.raises(ValueError, match="wall_seconds must be a positive number"):
        CodeEnv(sandbox={"wall_seconds": 0})
    assert CodeEnv(sandbox=SandboxLimits(cpu_seconds=2)).options.sandbox.cpu_seconds == 2


def test_default_feedback_does_not_leak_expected_outputs():
    """A policy shown expected outputs learns to hard-code them: the default shows only a count."""
    env = CodeEnv(max_turns=3, **FAST)
    assert env.options.feedback == "pass_count"
    env.reset(SUM_ROW)
    first = env.step(answer("print(3)")).observation[0]["content"]
    assert "1 of 4 tests passed" in first
    assert "Expected" not in first and "10 -4" not in first and "\n6" not in first
    silent = CodeEnv(max_turns=2, feedback="none", **FAST)
    silent.reset(SUM_ROW)
    text = silent.step(answer("print(3)")).observation[0]["content"]
    assert "passed" not in text and "Expected" not in text and "failed" in text
    with pytest.raises(ValueError, match="feedback must be one of"):
        CodeEnv(feedback="expected_output")


@pytest.mark.parametrize("program", ["print('\ud800')", "x = 1\n" + "#" * (2 * 1024 * 1024)])
def test_a_program_the_sandbox_cannot_hold_fails_the_episode(program):
    env = CodeEnv(sandbox={"wall_seconds": 1.0, "cpu_seconds": 1, "disk_bytes": 1024 * 1024})
    env.reset(SUM_ROW)
    result = env.step(answer(program))
    assert (result.reward, result.done) == (0.0, True)
    assert result.info["outcomes"][0] == "rejected" and result.info["rejected"]
