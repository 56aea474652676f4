import threading
import time

import pytest

from skyrl_envs.math_answers import answers_match, extract_answer, gold_answer, hash_answer, last_boxed, last_number
from skyrl_envs.math_env import GSM8KEnv, MathEnv, MathOptions

GSM8K_SOLUTION = "Natalia sold 48/2 = 24 clips in May.\nAltogether she sold 48+24 = 72 clips.\n#### 72"


def test_extractors():
    assert hash_answer(GSM8K_SOLUTION) == "72"
    assert hash_answer("#### 1,000\n") == "1,000"
    assert last_boxed("first \\boxed{1} then \\boxed{\\frac{a}{b^{2}}} end") == "\\frac{a}{b^{2}}"
    assert last_boxed("\\boxed{unclosed") is None
    assert last_number("12 apples, then 3.5 pears and -2") == "-2"
    assert last_number("3/4 of them") == "3/4"
    assert last_number("no digits") is None
    assert extract_answer("so 5\n#### 6", ("hash", "boxed", "last_number")) == "6"
    assert extract_answer("so 5 \\boxed{6}", ("hash", "last_number")) == "6"
    assert gold_answer(GSM8K_SOLUTION) == "72" and gold_answer("\\boxed{\\pi}") == "\\pi" and gold_answer(" 9 ") == "9"


@pytest.mark.parametrize("checker", ["math_verify", "sympy"])
@pytest.mark.parametrize("predicted, gold, equal", [
    ("72", "72", True),
    ("1,000", "1000", True),
    ("72.0", "72", True),
    ("\\$72", "72", True),
    ("3/4", "0.75", True),
    ("\\frac{1}{2}", "0.5", True),
    ("\\dfrac{1}{2}", "\\frac{1}{2}", True),
    ("2\\sqrt{2}", "\\sqrt{8}", True),
    ("\\frac{\\pi}{2}", "\\pi/2", True),
    ("73", "72", False),
    ("\\sqrt{3}", "\\sqrt{8}", False),
    (None, "72", False),
    ("", "72", False),
])
def test_equivalence(checker, predicted, gold, equal):
    assert answers_match(predicted, gold, checker=checker) is equal


def test_hostile_answers_are_neither_evaluated_nor_slow(tmp_path):
    marker = tmp_path / "ran"
    evil = f"__import__('os').system('touch {marker}')"
    started = time.monotonic()
    for checker in ("sympy", "math_verify"):
        assert answers_match(evil, "0", checker=checker) is False
        assert answers_match("9^{9^{9^{9}}}", "1", checker=checker) is False
        assert answers_match("x" * 5000, "1", checker=checker) is False
    assert not marker.exists()
    assert time.monotonic() - started < 10


def test_math_verify_works_off_the_main_thread():
    results = []
    thread = threading.Thread(target=lambda: results.append(answers_match("\\frac{2}{4}", "\\frac{1}{2}", checker="math_verify")))
    thread.start()
    thread.join()
    assert results == [True]


def gsm8k_row():
    return {"prompt": [{"role": "user", "content": "Natalia sold clips ..."}], "reward_spec": {"ground_truth": GSM8K_SOLUTION}}


@pytest.mark.parametrize("answer, reward", [
    ("48+24 = 72\n#### 72", 1.0),                 # right, GSM8K format
    ("so the answer is \\boxed{72}", 1.0),        # right, another format (not strict)
    ("She sold 72 clips.", 1.0),                  # right, last number
    ("#### 71", 0.0),                              # wrong
    ("#### 72\nActually #### 70", 0.0),            # the last answer counts
    ("I cannot tell.", 0.0),                       # malformed: no answer at all
])
def test_gsm8k_reward(answer, reward):
    env = GSM8KEnv()
    assert env.reset(gsm8k_row())[0]["role"] == "user"
    result = env.step(answer)
    assert (result.reward, result.done) == (reward, True)


def test_strict_accepts_only_the_first_format():
    env = GSM8KEnv(strict=True)
    env.reset(gsm8k_row())
    assert env.step("She sold 72 clips.").reward == 0.0
    env.reset(gsm8k_row())
    assert env.step("#### 72").reward == 1.0


@pytest.mark.parametrize("answer, reward", [
    ("The result is \\boxed{\\frac{1}{2}}", 1.0),
    ("The result is \\boxed{0.5}", 1.0),
    ("The result is \\boxed{\\frac{1}{3}}", 0.0),
    ("The result is \\boxed{", 0.0),
])
def test_math_reward(answer, reward):
    env = MathEnv()
    env.reset({"prompt": [{"role": "user", "content": "?"}], "reward_spec": {"ground_truth": "\\frac{1}{2}"}})
    assert env.step(answer).reward == reward


def test_multi_turn_retries_with_feedback():
    env = GSM8KEnv(max_turns=3)
    env.reset(gsm8k_row())
    first = env.step("#### 70")
    assert (first.reward, first.done) == (0.0, False)
    assert first.observation[0]["role"] == "user" and "70 is not correct" in first.observation[0]["content"]
    second = env.step("no idea")
    assert not second.done and "could not find a final answer" in second.observation[0]["content"]
    third = env.step("#### 72")
    assert (third.reward, third.done, third.info["turn"]) == (1.0, True, 3)

    env.reset(gsm8k_row())
    results = [env.step("#### 1") for _ in range(3)]
    assert [r.done for r in results] == [False, False, True] and results[-1].reward == 0.0


def test_options_are_validated():
    with pytest.raises(ValueError, match="answer_formats"):
        MathOptions(answer_formats=("latex",))
    with pytest.raises(ValueError, match="checker"):
        MathOptions(checker="wolfram")
    with pytest.raises(ValueError, match="max_turns"):
        MathOptions(max_turns=0)
    with pytest.raises(ValueError, match="ground_truth"):
        MathEnv().reset({"prompt": [{"role": "user", "content": "?"}]})
