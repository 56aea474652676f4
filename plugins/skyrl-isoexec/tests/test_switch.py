"""IsoExec's switch: one precedence rule (explicit ``isoexec.enabled`` > ``SKYRL_ISOEXEC`` > off),
the same in the driver, its Ray ranks and its engine, and a handshake verdict the RL loop reads
instead of knowing IsoExec by name."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from skyrl_core.config.loader import load_config
from skyrl_core.plugins.manager import get_plugin_manager
from skyrl_core.trainer.runtime import HandshakeError, handshake
from skyrl_core.types import HandshakeVerdict

REPO = Path(__file__).resolve().parents[3]


@pytest.mark.parametrize(
    ("variable", "overrides", "expected"),
    [
        (None, [], False),
        ("1", [], True),
        ("true", [], True),
        ("0", [], False),
        ("1", ["isoexec.enabled=false"], False),  # an explicit config value beats the variable
        (None, ["isoexec.enabled=true"], True),
    ],
)
def test_precedence_config_over_variable_over_default(tmp_path, monkeypatch, variable, overrides, expected):
    if variable is None:
        monkeypatch.delenv("SKYRL_ISOEXEC", raising=False)
    else:
        monkeypatch.setenv("SKYRL_ISOEXEC", variable)
    path = tmp_path / "c.yaml"
    path.write_text("model: {path: /nowhere}\n")
    cfg = load_config(str(path), overrides)
    assert cfg.plugins["isoexec"].enabled is expected


def test_run_start_mirrors_the_decision_into_the_variable_for_child_processes(monkeypatch):
    from skyrl_isoexec import state
    from skyrl_isoexec.config import IsoExecConfig

    pm = get_plugin_manager()
    monkeypatch.setenv("SKYRL_ISOEXEC", "1")
    saved = state.configure(None)
    try:
        class Cfg:
            plugins = {"isoexec": IsoExecConfig(enabled=False)}

        pm.hook.skyrl_on_run_start(config=Cfg(), run_dir="/tmp")
        assert "SKYRL_ISOEXEC" not in os.environ and not state.enabled()
        Cfg.plugins = {"isoexec": IsoExecConfig(enabled=True)}
        pm.hook.skyrl_on_run_start(config=Cfg(), run_dir="/tmp")
        assert os.environ["SKYRL_ISOEXEC"] == "1" and state.enabled()
    finally:
        state.configure(saved)


def test_run_exit_gives_the_switch_back(monkeypatch):
    """``skyrl_on_run_exit`` undoes ``skyrl_on_run_start``: the variable and the explicit config as
    they were (absent / off here, and set / on for a run inside a run), and a run that adopted
    nothing is a no-op."""
    from skyrl_isoexec import state
    from skyrl_isoexec.config import IsoExecConfig

    pm = get_plugin_manager()
    monkeypatch.delenv("SKYRL_ISOEXEC", raising=False)
    saved = state.configure(None)
    try:
        class On:
            plugins = {"isoexec": IsoExecConfig(enabled=True)}

        class Off:
            plugins = {"isoexec": IsoExecConfig(enabled=False)}

        pm.hook.skyrl_on_run_start(config=On(), run_dir="/runs/outer")
        assert os.environ["SKYRL_ISOEXEC"] == "1" and state.enabled()
        pm.hook.skyrl_on_run_start(config=Off(), run_dir="/runs/inner")
        assert "SKYRL_ISOEXEC" not in os.environ and not state.enabled()
        pm.hook.skyrl_on_run_exit(run_dir="/runs/inner")
        assert os.environ["SKYRL_ISOEXEC"] == "1" and state.enabled()
        pm.hook.skyrl_on_run_exit(run_dir="/runs/never-started")
        assert os.environ["SKYRL_ISOEXEC"] == "1" and state.enabled()
        pm.hook.skyrl_on_run_exit(run_dir="/runs/outer")
        assert "SKYRL_ISOEXEC" not in os.environ and not state.enabled()
    finally:
        state.configure(saved)


def test_a_run_that_fails_gives_the_switch_back_to_the_next_run_in_the_process(tmp_path, monkeypatch, fresh_plugin_manager):
    """``train`` with ``isoexec.enabled=true`` turns IsoExec on for its runtimes; when it stops with
    an error (here building the backend), the process is as before: the variable unset, IsoExec
    off, and the next config built in the process resolves ``isoexec.enabled`` to false."""
    import skyrl_core.trainer.rl as rl
    from skyrl_isoexec import state
    from tests.e2e.tiny_run import write_tiny_config
    from tests.rollout.envs import TestEnvironments

    fresh_plugin_manager.register_plugin(TestEnvironments(), "test-envs")
    monkeypatch.delenv("SKYRL_ISOEXEC", raising=False)
    seen = {}

    def refusing_backend(*args, **kwargs):
        seen["variable"], seen["enabled"] = os.environ.get("SKYRL_ISOEXEC"), state.enabled()
        raise RuntimeError("no backend today")

    monkeypatch.setattr(rl, "build_backend", refusing_backend)
    config = str(write_tiny_config(tmp_path, steps=1))
    cfg = load_config(config, ["isoexec.enabled=true", f"trainer.output_dir={tmp_path / 'run'}"],
                      plugin_manager=fresh_plugin_manager)
    with pytest.raises(RuntimeError, match="no backend today"):
        rl.train(cfg, plugin_manager=fresh_plugin_manager)
    assert seen == {"variable": "1", "enabled": True}  # on while the run built its runtimes
    assert "SKYRL_ISOEXEC" not in os.environ and not state.enabled()
    assert load_config(config, plugin_manager=fresh_plugin_manager).plugins["isoexec"].enabled is False


@pytest.mark.slow
def test_the_variable_alone_turns_isoexec_on_in_skyrl_train(tmp_path):
    """``SKYRL_ISOEXEC=1 skyrl train CONFIG`` (no isoexec section): trainer and engine logprobs agree
    bit for bit (logged mismatch exactly 0, old-logprob pass skipped after step 1). Negative control:
    the same variable with ``isoexec.enabled=false`` in the config runs IsoExec off, with a real
    mismatch: the explicit config value wins."""
    from skyrl_core.trainer.metrics import read_metrics
    from tests.e2e.tiny_run import write_tiny_config

    config = write_tiny_config(tmp_path, steps=2, mini_batches=2)
    env = {**os.environ, "SKYRL_ISOEXEC": "1", "OMP_NUM_THREADS": "1"}
    runs = {}
    for name, extra in (("variable", []), ("config_off", ["isoexec.enabled=false"])):
        run_dir = tmp_path / name
        done = subprocess.run(
            [sys.executable, "-m", "tests.e2e.tiny_run", str(config), "data.eval=null",
             f"trainer.output_dir={run_dir}", *extra],
            cwd=REPO, env=env, capture_output=True, text=True, timeout=600,
        )
        assert done.returncode == 0, done.stderr[-3000:]
        runs[name] = read_metrics(str(run_dir))
    on = runs["variable"]
    assert on[0]["mismatch/abs_logprob_diff_max"] == 0.0
    assert "mismatch/abs_logprob_diff_max" not in on[1]  # rollout logprobs reused: no pass measured it
    off = runs["config_off"]
    assert all(r["mismatch/abs_logprob_diff_max"] > 0 for r in off)
