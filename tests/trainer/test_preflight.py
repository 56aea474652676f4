"""``skyrl train`` checks every path it will read before it writes or loads anything."""

from __future__ import annotations

import json

import pytest
import yaml

from skyrl_core.config.errors import ConfigError
from skyrl_core.config.loader import structure_config
from skyrl_core.trainer.preflight import check_run_inputs
from tests.conftest import run_skyrl

TINY_MODEL = {"model_type": "qwen3", "vocab_size": 512, "hidden_size": 64, "intermediate_size": 128,
              "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 32}


def _row(a: int) -> dict:
    return {"prompt": [{"role": "user", "content": f"What is {a} + 1?"}], "reward_spec": {"ground_truth": str(a + 1)}}


def _config(tmp_path, **sections) -> dict:
    train = tmp_path / "train.jsonl"
    train.write_text("".join(json.dumps(_row(a)) + "\n" for a in range(4)))
    cfg = {"model": {"config": TINY_MODEL}, "engine": "torch", "backend": "fsdp", "environment": "arithmetic",
           "data": {"train": str(train), "prompts_per_step": 2}, "trainer": {"steps": 1, "output_dir": str(tmp_path / "run")}}
    for key, value in sections.items():
        cfg[key] = {**cfg.get(key, {}), **value}
    return cfg


def test_every_bad_path_is_reported_at_once_and_nothing_is_written(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    cfg = _config(
        tmp_path,
        model={"path": str(tmp_path / "no-model")},
        data={"train": str(tmp_path / "missing.jsonl"), "eval": str(blocker)},
        trainer={"output_dir": str(blocker / "run"), "resume": str(tmp_path / "no-checkpoint")},
    )
    del cfg["model"]["config"]
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(cfg))
    result = run_skyrl("train", str(path))
    assert result.returncode == 2, result.stderr
    err = result.stderr
    assert f"config error in {path}: 5 problems" in err
    assert f"data.train: dataset file '{tmp_path / 'missing.jsonl'}' does not exist" in err
    assert f"data.eval: dataset file '{blocker}' has suffix ''" in err
    assert f"model.path: '{tmp_path / 'no-model'}' does not exist" in err
    assert f"trainer.resume: '{tmp_path / 'no-checkpoint'}' is neither a checkpoint" in err
    assert f"trainer.output_dir: '{blocker / 'run'}': '{blocker}' is a file" in err
    assert "Traceback" not in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a-file", "bad.yaml", "train.jsonl"]  # no run dir


def test_a_broken_row_names_the_key_and_the_row(tmp_path):
    cfg = structure_config(_config(tmp_path))
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps(_row(1)) + "\n" + json.dumps({"prompt": "not a list"}) + "\n")
    with pytest.raises(ConfigError) as info:
        check_run_inputs(structure_config(_config(tmp_path, data={"train": str(bad)})))
    (issue,) = info.value.issues
    assert issue.path == "data.train" and "row 1" in issue.message, issue
    inputs = check_run_inputs(cfg)
    assert [r["reward_spec"]["ground_truth"] for r in inputs.train_rows] == ["1", "2", "3", "4"]
    assert inputs.eval_rows == [] and inputs.resume_from is None


def test_missing_train_data_and_an_empty_file(tmp_path):
    cfg = _config(tmp_path)
    del cfg["data"]["train"]
    with pytest.raises(ConfigError, match=r"data\.train: is not set"):
        check_run_inputs(structure_config(cfg))
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    with pytest.raises(ConfigError, match=r"data\.train: '.*empty\.jsonl' has no rows"):
        check_run_inputs(structure_config(_config(tmp_path, data={"train": str(empty)})))
