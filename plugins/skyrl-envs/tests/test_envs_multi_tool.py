import pytest

from skyrl_core.data import load_dataset
from skyrl_envs.multi_tool_env import MultiToolEnv, answers_agree, multi_tool_rows
from skyrl_envs.search_index import SHIPPED_CORPUS

ROWS = load_dataset(SHIPPED_CORPUS.parent.parent / "multi_tool" / "questions.jsonl")
GOLD_TIMES_OXYGEN = ROWS[0]  # 79 * 8 = 632
# A correct program gets ample wall time (a loaded machine can take seconds to start Python: a
# 1 s limit failed a right answer once); a runaway one is stopped by its 1 s of CPU.
FAST = {"sandbox": {"wall_seconds": 20.0, "cpu_seconds": 1}}


def test_shipped_questions_are_the_builders_rows():
    assert ROWS == multi_tool_rows()


def test_search_then_python_then_answer(index_dir):
    env = MultiToolEnv(index_dir=index_dir, **FAST)
    env.reset(GOLD_TIMES_OXYGEN)
    gold = env.step("<search>atomic number of gold</search>")
    assert "atomic number 79" in gold.observation[0]["content"] and gold.info["reason"] == "search"
    computed = env.step("<python>\nprint(79 * 8)\n</python>")
    assert computed.observation[0]["content"] == "632\n" and computed.info["reason"] == "python"
    fenced = env.step("<python>```python\nprint(2 + 2)\n```</python>")
    assert fenced.observation[0]["content"] == "4\n"
    done = env.step("<answer>632</answer>")
    assert (done.reward, done.done, done.info["turn"]) == (1.0, True, 4)


@pytest.mark.parametrize("answer, reward", [
    ("<answer>632</answer>", 1.0),
    ("<answer>632.0</answer>", 1.0),
    ("<answer>631</answer>", 0.0),
    ("<answer>six hundred</answer>", 0.0),
])
def test_answer_reward(index_dir, answer, reward):
    env = MultiToolEnv(index_dir=index_dir, **FAST)
    env.reset(GOLD_TIMES_OXYGEN)
    assert env.step(answer).reward == reward


def test_tool_errors_and_malformed_turns_are_observations(index_dir):
    env = MultiToolEnv(index_dir=index_dir, max_turns=4, sandbox={"wall_seconds": 3.0, "cpu_seconds": 1})  # (sleep 60 times out)
    env.reset(GOLD_TIMES_OXYGEN)
    crashed = env.step("<python>1/0</python>")
    assert "ZeroDivisionError" in crashed.observation[0]["content"] and not crashed.done
    slow = env.step("<python>import time; time.sleep(60)</python>")
    assert slow.observation[0]["content"] == "Error: the program ran out of time."
    reminder = env.step("I will just guess.")
    assert "No tool call or answer" in reminder.observation[0]["content"]
    last = env.step("<search>gold</search>")
    assert (last.done, last.reward, last.info["reason"]) == (True, 0.0, "max_turns")


def test_numeric_or_text_agreement():
    assert answers_agree("2954", ["2954"]) and answers_agree("2,954", ["2954"])
    assert answers_agree("Mars", ["mars"]) and not answers_agree("Venus", ["Mars"])


def test_python_cannot_read_the_shipped_answer_key(index_dir):
    key = SHIPPED_CORPUS.parent.parent / "multi_tool" / "questions.jsonl"
    env = MultiToolEnv(index_dir=index_dir, **FAST)
    env.reset(GOLD_TIMES_OXYGEN)
    seen = env.step(f"<python>print(open({str(key.resolve())!r}).read())</python>").observation[0]["content"]
    assert "632" not in seen and "No such file or directory" in seen


def test_model_text_the_sandbox_cannot_hold_is_an_observation(index_dir):
    env = MultiToolEnv(index_dir=index_dir, **FAST)
    env.reset(GOLD_TIMES_OXYGEN)
    seen = env.step("<python>print('\ud800')</python>")
    assert not seen.done and seen.observation[0]["content"].startswith("Error: the program could not be run")
