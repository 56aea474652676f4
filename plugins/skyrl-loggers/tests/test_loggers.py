"""Each logger writes what its own library reads back: the values of metrics.jsonl."""

from __future__ import annotations

import glob
import json
import os
import struct
import subprocess
import sys
from typing import Any

import numpy as np
import pytest

from skyrl_core.config.errors import ConfigError
from skyrl_core.config.loader import load_config
from skyrl_core.plugins.records import LoggerSpec
from skyrl_core.trainer.loggers import LoggerPlugin
from skyrl_core.trainer.metrics import MetricsLog, read_metrics
from skyrl_loggers.mlflow import mlflow_key


# --- each logger's output read back with the library's own reader: {step: {key: value}} ---------

Series = dict[int, dict[str, float]]


def tensorboard_series(run_dir: str) -> Series:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(os.path.join(run_dir, "tensorboard"), size_guidance={"scalars": 0})
    acc.Reload()
    out: Series = {}
    for tag in acc.Tags()["scalars"]:
        for event in acc.Scalars(tag):
            assert tag not in out.get(event.step, {}), f"{tag} logged twice at step {event.step}"
            out.setdefault(event.step, {})[tag] = event.value
    return out


def wandb_series(run_dir: str) -> Series:
    """History rows of the offline run: its ``.wandb`` file is a LevelDB-style log of wandb's own
    ``Record`` protobufs (wandb ships no Python reader for it any more), parsed with wandb's proto."""
    from wandb.proto import wandb_internal_pb2

    (path,) = glob.glob(os.path.join(run_dir, "wandb", "offline-run-*", "run-*.wandb"))
    data = open(path, "rb").read()
    assert data[:4] == b":W&B", data[:7]
    block, pos, pending, out = 32768, 7, b"", {}
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a header is padding
            pos += block - pos % block
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if length == 0 and kind == 0:
            break
        pending += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # FULL or LAST fragment
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            pending = b""
            if record.WhichOneof("record_type") == "history":
                row = {".".join(item.nested_key) or item.key: json.loads(item.value_json) for item in record.history.item}
                step = record.history.step.num
                values = {k: v for k, v in row.items() if not k.startswith("_")}
                assert not set(values) & set(out.get(step, {})), f"step {step} logged twice"
                out.setdefault(step, {}).update(values)
    return out


def mlflow_series(run_dir: str) -> tuple[Series, Any]:
    """The metrics of the only run in ``<run_dir>/mlruns`` and that run."""
    from mlflow.tracking import MlflowClient

    os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
    client = MlflowClient(tracking_uri="file:" + os.path.join(run_dir, "mlruns"))
    (experiment,) = [e for e in client.search_experiments() if e.name == "skyrl"]
    (run,) = client.search_runs([experiment.experiment_id])
    out: Series = {}
    for key in run.data.metrics:
        for metric in client.get_metric_history(run.info.run_id, key):
            out.setdefault(metric.step, {})[key] = metric.value
    return out, run


ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
TINY = os.path.join(ROOT, "examples", "tiny.yaml")
ALL = "trainer.loggers=[jsonl, tensorboard, wandb, mlflow]"


@pytest.fixture(autouse=True)
def _offline_wandb(monkeypatch):
    monkeypatch.delenv("WANDB_MODE", raising=False)  # the logger's own default must be offline
    monkeypatch.setenv("WANDB_SILENT", "true")
    for name in ("MLFLOW_TRACKING_URI", "MLFLOW_EXPERIMENT_NAME", "WANDB_PROJECT"):
        monkeypatch.delenv(name, raising=False)


def expected_series(run_dir: str) -> dict[int, dict[str, float]]:
    """Per step, the numbers metrics.jsonl holds (what every logger must show)."""
    out: dict[int, dict[str, float]] = {}
    for record in read_metrics(run_dir):
        values = {k: v for k, v in record.items()
                  if k != "step" and not isinstance(v, bool) and isinstance(v, (int, float))}
        out.setdefault(record["step"], {}).update(values)
    return out


def assert_loggers_match_jsonl(run_dir: str) -> int:
    """Every logger's read-back equals metrics.jsonl; returns how many values were compared."""
    expected = expected_series(run_dir)
    assert expected and all(expected.values())

    tb = tensorboard_series(run_dir)
    assert tb.keys() == expected.keys()
    for step, values in expected.items():
        assert tb[step].keys() == values.keys(), step
        for key, value in values.items():  # TensorBoard stores scalars as float32 (1e308 -> inf)
            with np.errstate(over="ignore"):
                    assert np.float32(tb[step][key]) == np.float32(value), (step, key, tb[step][key], value)

    assert wandb_series(run_dir) == expected

    ml, run = mlflow_series(run_dir)
    assert ml == {s: {mlflow_key(k): v for k, v in vals.items()} for s, vals in expected.items()}
    assert run.info.status == "FINISHED" and run.info.run_name == os.path.basename(run_dir)
    return sum(len(v) for v in expected.values())


def replay(pm, cfg, run_dir: str, steps: list[dict], eval_at: dict[int, dict]) -> None:
    """Drive the run events as the RL trainer does: eval before training (step 0), eval merged into
    the step record it belongs to, metrics.jsonl written alongside."""
    pm.hook.skyrl_on_run_start(config=cfg, run_dir=run_dir)
    log = MetricsLog(run_dir)
    pm.hook.skyrl_on_eval_end(step=0, metrics=dict(eval_at[0]))
    log.write({"step": 0, **eval_at[0]})
    for record in steps:
        step = record["step"]
        if step in eval_at:
            pm.hook.skyrl_on_eval_end(step=step, metrics=dict(eval_at[step]))
            record = {**record, **eval_at[step]}
        log.write(record)
        pm.hook.skyrl_on_step_end(step=step, metrics=dict(record))
    pm.hook.skyrl_on_run_end(metrics=dict(log.history[-1]), run_dir=run_dir)


def test_a_fake_metrics_stream_reads_back_identically_from_every_logger(tmp_path, fresh_plugin_manager):
    run_dir = str(tmp_path / "run")
    os.makedirs(run_dir)
    cfg = load_config(TINY, [ALL, f"trainer.output_dir={run_dir}"], plugin_manager=fresh_plugin_manager)
    evals = {s: {"eval/accuracy": s / 7, "eval/pass@4": 1 / 3 + s, "time/eval": 0.125 * s} for s in (0, 2, 3)}
    steps = [{"step": s, "loss": 1 / (s + 3), "reward/mean": -0.1 * s, "tokens": 7 * s, "kl": float("inf"),
              "grad_norm": float("nan") if s == 2 else 2.0**-s, "skipped": s == 1, "note": "text"}
             for s in (1, 2, 3)]
    replay(fresh_plugin_manager, cfg, run_dir, steps, evals)

    compared = assert_loggers_match_jsonl(run_dir)
    assert compared == 3 * 3 + 3 * 5 - 1  # 3 evals, 5 numbers a step, less the NaN (metrics.jsonl stores null)
    # the values that must survive: an int, an infinity (as metrics.jsonl stores it), the '@' key
    wb = wandb_series(run_dir)
    assert wb[3]["tokens"] == 21 and wb[1]["kl"] == 1e308 and "grad_norm" not in wb[2]
    assert wb[2]["eval/pass@4"] == 1 / 3 + 2 and mlflow_series(run_dir)[0][2]["eval/pass_4"] == 1 / 3 + 2


def test_loggers_in_a_tiny_training_run(tmp_path, fresh_plugin_manager):
    from skyrl_core.trainer.rl import train

    data = os.path.join(ROOT, "examples", "data", "arithmetic")
    cfg = load_config(TINY, [ALL, f"trainer.output_dir={tmp_path / 'run'}", "trainer.progress=false",
                             "trainer.plot=false", f"data.train={data}/train.jsonl", f"data.eval={data}/eval.jsonl"],
                      plugin_manager=fresh_plugin_manager)
    result = train(cfg, plugin_manager=fresh_plugin_manager)
    assert [r["step"] for r in result.history] == [0, 1, 2]
    assert assert_loggers_match_jsonl(result.run_dir) > 40


def test_a_logger_that_fails_to_start_refuses_the_run_before_training(tmp_path, fresh_plugin_manager, monkeypatch):
    from skyrl_core.trainer.rl import train

    monkeypatch.setenv("MLFLOW_TRACKING_URI", "nosuchscheme://nowhere")
    run_dir = tmp_path / "run"
    cfg = load_config(TINY, ["trainer.loggers=[jsonl, mlflow]", f"trainer.output_dir={run_dir}"],
                      plugin_manager=fresh_plugin_manager)
    with pytest.raises(ConfigError) as info:
        train(cfg, plugin_manager=fresh_plugin_manager)
    text = str(info.value)
    assert "trainer.loggers: logger 'mlflow' failed to start" in text and "nosuchscheme" in text
    assert not (run_dir / "metrics.jsonl").exists() and not (run_dir / "checkpoints").exists()


def test_a_failing_sink_is_reported_by_name_and_an_unselected_one_is_never_built(tmp_path, fresh_plugin_manager):
    fresh_plugin_manager.register_plugin(
        LoggerPlugin(LoggerSpec(name="broken", factory="skyrl_core.no_such_module:Sink")), "broken-logger")
    cfg = load_config(TINY, ["trainer.loggers=[broken]"], plugin_manager=fresh_plugin_manager)
    with pytest.raises(ConfigError, match="logger 'broken' failed to start: ModuleNotFoundError"):
        fresh_plugin_manager.hook.skyrl_on_run_start(config=cfg, run_dir=str(tmp_path))
    plain = load_config(TINY, [], plugin_manager=fresh_plugin_manager)
    assert plain.trainer.loggers == ("jsonl",)
    fresh_plugin_manager.hook.skyrl_on_run_start(config=plain, run_dir=str(tmp_path))  # not selected: not built


def test_unknown_or_repeated_logger_names_are_refused_at_validation(fresh_plugin_manager):
    with pytest.raises(ConfigError) as info:
        load_config(TINY, ["trainer.loggers=[jsonl, tensorbord, wandb, wandb]"], plugin_manager=fresh_plugin_manager)
    text = str(info.value)
    assert "trainer.loggers[1]: 'tensorbord' is not a registered logger" in text
    assert "did you mean 'tensorboard'?" in text and "allowed: jsonl, mlflow, tensorboard, wandb" in text
    assert "trainer.loggers[3]: 'wandb' is listed twice" in text
    with pytest.raises(ConfigError, match="trainer.loggers: 'wandb' is invalid: expected a list of strings"):
        load_config(TINY, ["trainer.loggers=wandb"], plugin_manager=fresh_plugin_manager)


def test_a_logger_library_is_imported_only_when_selected():
    code = ("import sys\n"
            "from skyrl_core.config.loader import load_config\n"
            "from skyrl_core.plugins.manager import get_plugin_manager\n"
            f"cfg = load_config({TINY!r}, ['trainer.loggers=[jsonl]'])\n"
            "get_plugin_manager().hook.skyrl_on_run_start(config=cfg, run_dir='.')\n"
            "print(sorted(m for m in ('wandb', 'mlflow', 'tensorboard') if m in sys.modules))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr
