"""Relative paths in a config file resolve against the file's directory (inputs) or the current
directory (outputs); paths typed on the command line against the current directory."""

from __future__ import annotations

import os
from pathlib import Path

import attrs
import pytest
import yaml
from click.testing import CliRunner

from skyrl_core.cli.main import cli
from skyrl_core.config.loader import load_config
from skyrl_core.config.paths import resolve_paths
from skyrl_core.trainer.preflight import check_run_inputs

ROOT = Path(__file__).resolve().parents[2]
QUICKSTART = ROOT / "examples" / "quickstart.yaml"


@pytest.fixture
def elsewhere(tmp_path, monkeypatch) -> Path:
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    monkeypatch.chdir(cwd)
    return cwd


def test_config_paths_resolve_against_the_file_outputs_against_the_current_directory(elsewhere):
    cfg = load_config(str(QUICKSTART))
    assert cfg.data.train == str(ROOT / "examples/data/arithmetic/train.jsonl")
    assert cfg.data.eval == str(ROOT / "examples/data/arithmetic/eval.jsonl")
    assert cfg.model.path == os.path.expanduser("~/.cache/skyrl/models/SmolLM2-135M-Instruct")
    assert cfg.trainer.output_dir == str(elsewhere / "runs/quickstart")
    # what the run reads is there: the pre-flight checks pass from this directory
    inputs = check_run_inputs(cfg)
    assert len(inputs.train_rows) == 1000 and len(inputs.eval_rows) == 100


def test_command_line_paths_stay_relative_to_the_current_directory(elsewhere):
    cfg = load_config(str(QUICKSTART), ["data.eval=held_out.jsonl", "model={tokenizer: tok, path: m}",
                                        "trainer.resume=runs/quickstart"])
    assert cfg.data.eval == str(elsewhere / "held_out.jsonl")
    assert cfg.model.tokenizer == str(elsewhere / "tok") and cfg.model.path == str(elsewhere / "m")
    assert cfg.trainer.resume == str(elsewhere / "runs/quickstart")
    assert cfg.data.train == str(ROOT / "examples/data/arithmetic/train.jsonl")  # not overridden: the file's


def test_plugin_options_mark_their_paths(elsewhere, tmp_path):
    config = tmp_path / "conf" / "search.yaml"
    config.parent.mkdir()
    config.write_text(yaml.safe_dump({
        "model": {"path": "../models/m"},
        "environment": {"name": "search", "options": {"corpus_path": "corpus.jsonl", "index_dir": "index"}},
    }))
    cfg = load_config(str(config))
    assert cfg.model.path == str(tmp_path / "models/m")
    assert cfg.environment.options.corpus_path == str(config.parent / "corpus.jsonl")  # an input
    assert cfg.environment.options.index_dir == str(elsewhere / "index")  # an output
    cfg = load_config(str(config), ["environment.options.corpus_path=c.jsonl"])
    assert cfg.environment.options.corpus_path == str(elsewhere / "c.jsonl")
    # the default '' (build the index in the cache) is not a path and stays ''
    assert load_config(None, ["model.path=/m", "environment.name=search"]).environment.options.index_dir == ""


def test_config_show_prints_absolute_paths_from_another_directory(elsewhere):
    (elsewhere / "e.jsonl").write_text((ROOT / "examples/data/arithmetic/eval.jsonl").read_text())
    result = CliRunner().invoke(cli, ["config", "show", str(QUICKSTART), "data.eval=e.jsonl"])
    assert result.exit_code == 0, result.output
    shown = yaml.safe_load(result.output)
    assert shown["data"]["train"] == str(ROOT / "examples/data/arithmetic/train.jsonl")
    assert shown["data"]["eval"] == str(elsewhere / "e.jsonl")
    assert shown["trainer"]["output_dir"] == str(elsewhere / "runs/quickstart")


def test_a_path_kind_other_than_input_or_output_is_refused():
    @attrs.frozen
    class Options:
        where: str = attrs.field(default="x", metadata={"path": "somewhere"})

    with pytest.raises(ValueError, match="path='somewhere' is not one of"):
        resolve_paths(Options(), config_dir="/")
