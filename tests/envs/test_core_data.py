import json

import pytest

from skyrl_core.data import DatasetError, load_dataset, load_datasets, write_jsonl, write_parquet

ROWS = [
    {"prompt": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2 + 2?"}],
     "env_class": "arithmetic", "reward_spec": {"method": "rule", "ground_truth": "4"},
     "extra_info": {"split": "train", "index": 0}, "db_id": "shop"},
    {"prompt": [{"role": "user", "content": "What is 3 + 3?"}], "env_class": "arithmetic",
     "reward_spec": {"method": "rule", "ground_truth": "6"}, "extra_info": {"split": "train", "index": 1}, "db_id": None},
]


def test_jsonl_and_parquet_round_trip_with_extra_columns(tmp_path):
    jsonl = load_dataset(write_jsonl(ROWS, tmp_path / "d.jsonl"))
    parquet = load_dataset(write_parquet(ROWS, tmp_path / "d.parquet"))
    assert jsonl == ROWS
    assert parquet == ROWS  # structs, lists and free columns survive
    assert load_datasets([tmp_path / "d.jsonl", tmp_path / "d.parquet"]) == ROWS + ROWS


def test_an_upstream_style_parquet_written_by_pandas_loads(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    table = pa.table({
        "data_source": ["openai/gsm8k"],
        "prompt": [[{"role": "user", "content": "Natalia sold clips..."}]],
        "env_class": ["gsm8k"],
        "reward_spec": [{"method": "rule", "ground_truth": "72"}],
        "extra_info": [{"split": "train", "index": 0, "answer": "#### 72", "question": "Natalia..."}],
    })
    pq.write_table(table, tmp_path / "train.parquet")
    (row,) = load_dataset(tmp_path / "train.parquet")
    assert row["env_class"] == "gsm8k" and row["reward_spec"]["ground_truth"] == "72"
    assert row["data_source"] == "openai/gsm8k" and row["prompt"] == [{"role": "user", "content": "Natalia sold clips..."}]


def test_defaults_for_optional_columns(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text(json.dumps({"prompt": [{"role": "user", "content": "hi"}]}) + "\n\n")
    (row,) = load_dataset(path, default_env_class="arithmetic")
    assert row == {"prompt": [{"role": "user", "content": "hi"}], "env_class": "arithmetic",
                   "reward_spec": {}, "extra_info": {}}
    with pytest.raises(DatasetError, match=r"d.jsonl: row 0 has no 'env_class' and no default"):
        load_dataset(path)


@pytest.mark.parametrize("line, message", [
    ("{not json", r"line 2 is not valid JSON"),
    ('{"env_class": "x"}', r"row 1 has no 'prompt' column \(columns: env_class\)"),
    ('{"prompt": "What is 2+2?", "env_class": "x"}', r"row 1: 'prompt' must be a non-empty list"),
    ('{"prompt": [{"role": "robot", "content": "hi"}], "env_class": "x"}', r"role 'robot'; allowed: system, user"),
    ('{"prompt": [{"role": "user"}], "env_class": "x"}', r"prompt message 0 must have a string 'content'"),
    ('{"prompt": [{"role": "user", "content": "hi"}], "env_class": "x", "reward_spec": 3}', r"'reward_spec' must be an object"),
])
def test_bad_rows_are_named_by_file_and_row(tmp_path, line, message):
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps(ROWS[1]) + "\n" + line + "\n")
    with pytest.raises(DatasetError, match=message) as caught:
        load_dataset(path)
    assert str(path) in str(caught.value)


def test_missing_files_and_unknown_formats_are_named(tmp_path):
    with pytest.raises(DatasetError, match=r"'.*nowhere.jsonl' does not exist"):
        load_dataset(tmp_path / "nowhere.jsonl")
    (tmp_path / "d.csv").write_text("prompt\n")
    with pytest.raises(DatasetError, match=r"suffix '.csv'; allowed: .jsonl, .json, .parquet"):
        load_dataset(tmp_path / "d.csv")
    (tmp_path / "d.json").write_text('{"prompt": []}')
    with pytest.raises(DatasetError, match="must hold a list of rows"):
        load_dataset(tmp_path / "d.json")
    (tmp_path / "broken.parquet").write_bytes(b"not parquet")
    with pytest.raises(DatasetError, match="cannot read parquet"):
        load_dataset(tmp_path / "broken.parquet")
