"""`skyrl eval`: the evaluation of a saved checkpoint is the trainer's own evaluation at that step."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from skyrl_core.cli.main import cli
from skyrl_core.config.loader import load_config
from skyrl_core.trainer.evaluation_run import run_evaluation
from skyrl_core.trainer.rl import train
from tests.e2e.tiny_run import write_tiny_config
from tests.rollout.envs import TestEnvironments


def _eval_part(record: dict) -> dict:
    return {k: v for k, v in record.items() if k.startswith("eval/")}


def test_eval_of_a_checkpoint_equals_the_trainers_eval_at_that_step(tmp_path, fresh_plugin_manager):
    fresh_plugin_manager.register_plugin(TestEnvironments(), "test-envs")
    # sampled evaluation (eval_temperature 1.0 in the tiny config), 2 samples a prompt: pass@2 != accuracy
    config = write_tiny_config(tmp_path, steps=4, eval_every=2, checkpoint_every=2, mini_batches=1)
    overrides = ["generation.eval_n_samples=2"]
    cfg = load_config(str(config), overrides, plugin_manager=fresh_plugin_manager)
    history = train(cfg, plugin_manager=fresh_plugin_manager).history
    by_step = {r["step"]: _eval_part(r) for r in history if "eval/accuracy" in r}
    assert sorted(by_step) == [0, 2, 4]
    assert by_step[2] != by_step[4] != by_step[0]  # training changed what evaluation sees

    run = tmp_path / "run"
    for step in (2, 4):
        report = run_evaluation(cfg, checkpoint=str(run / "checkpoints" / f"step_00000{step}"),
                                output=str(tmp_path / f"eval{step}.json"), plugin_manager=fresh_plugin_manager)
        assert report.step == step
        assert _eval_part(report.metrics) == by_step[step], step
        saved = json.loads((tmp_path / f"eval{step}.json").read_text())
        assert _eval_part(saved["metrics"]) == by_step[step] and saved["prompts"] == 16 and saved["samples_per_prompt"] == 2

    # the CLI: a run directory means its latest checkpoint (step 4); one summary line; JSON next to the run
    result = CliRunner().invoke(cli, ["eval", str(config), *overrides, f"checkpoint={run}"])
    assert result.exit_code == 0, result.output
    (line,) = result.output.strip().splitlines()
    assert line.startswith("eval (checkpoint step 4, 16 prompts x 2 samples): accuracy=") and "pass@2=" in line
    saved = json.loads((run / "eval_step_000004.json").read_text())
    assert _eval_part(saved["metrics"]) == by_step[4] and saved["step"] == 4


def test_eval_refuses_bad_inputs_before_any_work(tmp_path, fresh_plugin_manager):
    fresh_plugin_manager.register_plugin(TestEnvironments(), "test-envs")
    config = write_tiny_config(tmp_path)
    result = CliRunner().invoke(cli, ["eval", str(config), "data.eval=null", f"checkpoint={tmp_path / 'nowhere'}"])
    assert result.exit_code == 2
    assert "data.eval: is not set: skyrl eval needs a dataset of prompts" in result.output
    assert f"checkpoint: '{tmp_path / 'nowhere'}' is neither a checkpoint" in result.output
    assert not (tmp_path / "run").exists()
