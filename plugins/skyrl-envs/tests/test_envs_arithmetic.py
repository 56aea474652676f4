
import pytest

from skyrl_core.data import load_dataset
from skyrl_envs.arithmetic import ArithmeticEnv, ArithmeticOptions, arithmetic_rows, parse_integer_answer, write_arithmetic_splits


@pytest.mark.parametrize("text, expected", [
    ("46", 46),
    ("12 + 34 = 46", 46),
    ("The answer is 46.", 46),
    ("\\boxed{46} (I also considered 7)", 46),
    ("2,401", 2401),
    ("-7", -7),
    ("I do not know", None),
    ("", None),
])
def test_parse_takes_the_box_else_the_last_integer(text, expected):
    assert parse_integer_answer(text) == expected


def row(a, b):
    return {"prompt": [{"role": "user", "content": f"What is {a} + {b}?"}], "reward_spec": {"ground_truth": str(a + b)}}


@pytest.mark.parametrize("answer, reward", [("46", 1.0), ("It is 46", 1.0), ("45", 0.0), ("forty-six", 0.0), ("", 0.0)])
def test_reward_right_wrong_malformed(answer, reward):
    env = ArithmeticEnv()
    assert env.reset(row(12, 34)) == row(12, 34)["prompt"]
    result = env.step(answer)
    assert (result.reward, result.done, result.observation) == (reward, True, [])
    assert result.info["answer"] == 46


def problems(env, count):
    return [env.reset({})[0]["content"] for _ in range(count)]


def test_an_empty_row_gets_a_seeded_problem_of_its_own():
    assert problems(ArithmeticEnv(seed=3), 5) == problems(ArithmeticEnv(seed=3), 5)  # same seed, same problems
    assert problems(ArithmeticEnv(seed=3), 5) != problems(ArithmeticEnv(seed=4), 5)
    assert len(set(problems(ArithmeticEnv(seed=3), 5))) > 1  # one instance moves on
    # fresh instances (one per episode, as the rollout makes them) agree on a row's problem ...
    group = [ArithmeticEnv().reset({"extra_info": {"index": 7}}) for _ in range(4)]
    assert all(messages == group[0] for messages in group)
    # ... and different rows get different problems
    assert len({ArithmeticEnv().reset({"extra_info": {"index": i}})[0]["content"] for i in range(10)}) > 5
    env = ArithmeticEnv(seed=3, min_operand=10, max_operand=20)
    content = env.reset({})[0]["content"]
    a, b = (int(x) for x in content.removeprefix("What is ").split("?")[0].split(" + "))
    assert 10 <= a <= 20 and 10 <= b <= 20 and "just the number" in content
    assert env.step(str(a + b)).reward == 1.0


def test_a_row_with_operands_but_no_prompt_is_built():
    env = ArithmeticEnv()
    assert env.reset({"extra_info": {"a": 7, "b": 5, "op": "*"}})[0]["content"].startswith("What is 7 * 5?")
    assert env.step("35").reward == 1.0


def test_episode_order_is_enforced():
    env = ArithmeticEnv()
    with pytest.raises(RuntimeError, match="reset"):
        env.step("1")
    env.reset(row(1, 1))
    env.step("2")
    with pytest.raises(RuntimeError, match="over"):
        env.step("2")


def test_splits_are_deterministic_disjoint_and_loadable(tmp_path):
    train, held_out = arithmetic_rows(300, 50, seed=1)
    assert (train, held_out) == arithmetic_rows(300, 50, seed=1)
    assert train != arithmetic_rows(300, 50, seed=2)[0]
    key = lambda r: (r["extra_info"]["a"], r["extra_info"]["b"], r["extra_info"]["op"])
    assert len({key(r) for r in train} | {key(r) for r in held_out}) == 350
    paths = write_arithmetic_splits(tmp_path, 300, 50, seed=1)
    assert paths["train"].read_bytes() == write_arithmetic_splits(tmp_path / "again", 300, 50, seed=1)["train"].read_bytes()
    loaded = load_dataset(paths["eval"])
    assert loaded == held_out
    env = ArithmeticEnv()
    env.reset(loaded[0])
    assert env.step(loaded[0]["reward_spec"]["ground_truth"]).reward == 1.0
    with pytest.raises(ValueError, match="only 2500 distinct"):
        arithmetic_rows(2500, 1)


def test_options_are_validated():
    with pytest.raises(ValueError, match=r"subset of \['\*', '\+', '-'\]"):
        ArithmeticOptions(operations=("^",))
    with pytest.raises(ValueError, match="max_operand"):
        ArithmeticOptions(min_operand=5, max_operand=2)
    with pytest.raises(ValueError, match="integer"):
        ArithmeticEnv().reset({"prompt": [{"role": "user", "content": "?"}], "reward_spec": {"ground_truth": "x"}})
