"""A row's env_class never silently overrides environment.name: a dataset naming other
environments is refused before any work, unless data.env_class_from_rows says to follow the rows."""

from __future__ import annotations

import pytest

from skyrl_core.config.errors import ConfigError
from skyrl_core.config.loader import load_config
from skyrl_core.data import write_jsonl
from skyrl_core.trainer.preflight import check_run_inputs


def _row(env_class: str | None) -> dict:
    row = {"prompt": [{"role": "user", "content": "What is 1 + 1?"}], "reward_spec": {"ground_truth": "2"}}
    return {**row, "env_class": env_class} if env_class else row


def _config(tmp_path, rows, *overrides):
    write_jsonl(rows, tmp_path / "train.jsonl")
    return load_config(None, ["model.config={model_type: qwen3}", f"data.train={tmp_path / 'train.jsonl'}",
                              f"trainer.output_dir={tmp_path / 'run'}", "environment.name=arithmetic", *overrides])


def test_rows_of_the_configured_environment_or_without_one_run_in_it(tmp_path):
    inputs = check_run_inputs(_config(tmp_path, [_row("arithmetic"), _row(None)]))
    assert [r["env_class"] for r in inputs.train_rows] == ["arithmetic", "arithmetic"]


def test_rows_naming_another_environment_are_refused_by_default(tmp_path):
    with pytest.raises(ConfigError) as error:
        check_run_inputs(_config(tmp_path, [_row("arithmetic"), _row("gsm8k"), _row("gsm8k")]))
    text = error.value.render()
    assert "data.train: 2 of 3 rows (the first: row 1) name env_class 'gsm8k', not environment.name 'arithmetic'" in text
    assert "data.env_class_from_rows=true" in text


def test_env_class_from_rows_follows_each_row(tmp_path):
    cfg = _config(tmp_path, [_row("arithmetic"), _row("gsm8k"), _row(None)], "data.env_class_from_rows=true")
    assert [r["env_class"] for r in check_run_inputs(cfg).train_rows] == ["arithmetic", "gsm8k", "arithmetic"]


def test_env_class_from_rows_refuses_an_unregistered_environment(tmp_path):
    cfg = _config(tmp_path, [_row("arithmetic"), _row("aritmetic")], "data.env_class_from_rows=true")
    with pytest.raises(ConfigError, match="row 1: env_class .aritmetic. is not a registered environment"):
        check_run_inputs(cfg)
