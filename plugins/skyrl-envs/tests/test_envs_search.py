import json

import pytest

from skyrl_core.data import load_dataset
from skyrl_envs.qa import accepted_answers, exact_match, normalize_answer
from skyrl_envs.search_env import SearchEnv, search_rows
from skyrl_envs.search_index import SHIPPED_CORPUS, SearchIndex

ROWS = load_dataset(SHIPPED_CORPUS.parent / "questions.jsonl")
CANBERRA = next(r for r in ROWS if "Australia" in r["prompt"][-1]["content"])


def test_shipped_questions_are_the_builders_rows():
    assert ROWS == search_rows()


def test_the_index_ranks_the_relevant_passage_first(index_dir):
    index = SearchIndex(index_dir=index_dir)
    assert index.search("atomic number of gold", 3)[0][0] == "Gold"
    assert index.search("moons Phobos Deimos", 1)[0][0] == "Mars"
    assert index.search("discovering penicillin", 2)[0][0] == "Penicillin"  # porter stemming
    assert index.search("???", 3) == []
    for hostile in ['" OR 1=1 --', "NEAR(a b) AND NOT *", "title: x", "'); DROP TABLE passages; --"]:
        index.search(hostile, 3)  # quoted words only: FTS5 syntax from the model is never parsed
    assert len(index.search("the", 3)) <= 3


def test_the_index_is_built_once(index_dir):
    first = SearchIndex(index_dir=index_dir)
    stamp = first.path.stat().st_mtime_ns
    second = SearchIndex(index_dir=index_dir)
    assert second.path == first.path and second.path.stat().st_mtime_ns == stamp
    assert [p.suffix for p in first.path.parent.iterdir()].count(".partial") == 0


def test_an_upstream_style_corpus_loads(tmp_path, index_dir):
    corpus = tmp_path / "wiki.jsonl"
    corpus.write_text(json.dumps({"id": "1", "contents": "\"Zorblat\"\nZorblat is a made-up word for a teapot."}) + "\n")
    index = SearchIndex(corpus, index_dir=index_dir)
    assert "teapot" in index.search("zorblat", 1)[0][1]
    corpus.write_text("not json\n")
    with pytest.raises(ValueError, match="line 1 is not valid JSON"):
        SearchIndex(corpus, index_dir=index_dir)


@pytest.mark.parametrize("answer, reward", [
    ("<answer>Canberra</answer>", 1.0),
    ("<answer> the canberra. </answer>", 1.0),      # normalised
    ("<answer>Sydney</answer>", 0.0),               # wrong
    ("<answer></answer>", 0.0),                      # malformed: empty
    ("<answer>Canberra, probably</answer>", 0.0),
])
def test_answer_reward(index_dir, answer, reward):
    env = SearchEnv(index_dir=index_dir)
    env.reset(CANBERRA)
    result = env.step(answer)
    assert (result.reward, result.done) == (reward, True)


def test_search_then_answer(index_dir):
    env = SearchEnv(index_dir=index_dir, top_k=2)
    assert env.reset(CANBERRA)[0]["role"] == "system"
    searched = env.step("I should look it up. <search>capital of Australia</search>")
    text = searched.observation[0]["content"]
    assert not searched.done and text.startswith("<information>") and "Doc 1 (Title: Canberra)" in text
    assert "Doc 3" not in text
    assert env.step("<answer>Canberra</answer>").reward == 1.0


def test_malformed_turns_and_running_out_of_turns(index_dir):
    env = SearchEnv(index_dir=index_dir, max_turns=2)
    env.reset(CANBERRA)
    reminder = env.step("Canberra")  # no tags
    assert not reminder.done and "No <search> or <answer>" in reminder.observation[0]["content"]
    last = env.step("<search>capital</search>")
    assert (last.done, last.reward, last.info["reason"]) == (True, 0.0, "max_turns")


def test_answer_matching():
    assert normalize_answer("The  Danube!") == "danube"
    assert accepted_answers({"target": ["Ag"]}) == ["Ag"] and accepted_answers("x") == ["x"]
    assert exact_match("berners-lee", ["Tim Berners-Lee", "Berners-Lee"])
    assert not exact_match(None, ["x"]) and not exact_match("", [""])
    with pytest.raises(ValueError, match="target"):
        accepted_answers({"answer": "x"})


def test_environments_share_one_open_index(index_dir):
    first, second = SearchEnv(index_dir=index_dir), SearchEnv(index_dir=index_dir)
    assert first.index is second.index  # a fresh environment per episode does not reopen the index
