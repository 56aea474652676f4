"""A misbehaving installed plugin is isolated: it is listed as failed with its error, and every
command (and every other plugin) goes on. The plugins are real installed distributions (the
fixture package tests/fixtures/skyrl-hostile-plugins, installed into a temporary directory on
PYTHONPATH, not into the venv), run through the real ``skyrl`` CLI."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from skyrl_core.plugins import hookimpl
from skyrl_core.plugins.records import InferenceEngineSpec
from tests.conftest import FIXTURES, run_skyrl

HOSTILE = "skyrl-hostile-plugins"


@pytest.fixture(scope="module")
def hostile_site(tmp_path_factory) -> str:
    target = tmp_path_factory.mktemp("hostile-site")
    subprocess.run(
        [sys.executable, "-m", "pip", "-q", "install", "--no-deps", "--no-build-isolation", "--target", str(target),
         str(FIXTURES / HOSTILE)],
        check=True, capture_output=True, timeout=300,
    )
    return str(target)


def _skyrl(site: str, *args: str, **env: str) -> subprocess.CompletedProcess:
    path = os.pathsep.join(p for p in (site, os.environ.get("PYTHONPATH")) if p)
    return run_skyrl(*args, env={"PYTHONPATH": path, **env})


def test_plugins_that_exit_interrupt_or_clash_are_listed_and_the_cli_goes_on(hostile_site):
    result = _skyrl(hostile_site, "plugins", "list", "--json")
    assert result.returncode == 0, result.stderr
    rows = {r["name"]: r for r in json.loads(result.stdout)}
    assert rows["exits-at-import"]["status"] == "failed"
    assert "SystemExit: a plugin that ends the process when imported" in rows["exits-at-import"]["error"]
    assert rows["interrupts-at-import"]["status"] == "failed"
    assert "KeyboardInterrupt" in rows["interrupts-at-import"]["error"]
    assert rows["exits-adding-commands"]["status"] == "failed"
    assert "skyrl_add_cli_commands: SystemExit: 3" in rows["exits-adding-commands"]["error"]
    assert rows["registers-twice"]["status"] == "failed"
    assert "'hostile_twice' is registered twice" in rows["registers-twice"]["error"]
    assert rows["registers-twice"]["provides"] == []  # all or nothing
    assert rows["fsdp"]["status"] == "ok" and "training_backend:fsdp" in rows["fsdp"]["provides"]
    assert "warning: plugin 'exits-adding-commands' failed to add commands" in result.stderr


def test_missing_requirements_are_shown_without_importing_them(hostile_site):
    result = _skyrl(hostile_site, "plugins", "list", "--json")
    rows = {r["name"]: r for r in json.loads(result.stdout)}
    assert rows["needs-absent-package"]["status"] == "ok"
    assert rows["needs-absent-package"]["missing_requirements"] == ["skyrl-absent-dependency>=1.0"]
    assert rows["fsdp"]["missing_requirements"] == []
    table = _skyrl(hostile_site, "plugins", "list", COLUMNS="200")
    assert "missing dependencies" in table.stdout
    assert "needs skyrl-absent-dependency>=1.0, not installed" in table.stdout


def test_config_show_works_for_everyone_else(hostile_site, tmp_path):
    config = tmp_path / "c.yaml"
    config.write_text("model: {config: {model_type: qwen3}}\nenvironment: arithmetic\n")
    result = _skyrl(hostile_site, "config", "show", str(config), "--skip-checks")
    assert result.returncode == 0, result.stderr
    assert "name: arithmetic" in result.stdout


def test_an_unknown_name_in_skyrl_plugins_warns(hostile_site):
    result = _skyrl(hostile_site, "plugins", "list", "--json", SKYRL_PLUGINS="fsdp,fsbp")
    assert result.returncode == 0, result.stderr
    assert "warning: SKYRL_PLUGINS names 'fsbp', which is not an installed plugin; installed:" in result.stderr
    rows = {r["name"]: r for r in json.loads(result.stdout)}
    assert rows["fsbp"]["status"] == "not installed"
    assert rows["fsdp"]["status"] == "ok" and rows["exits-at-import"]["status"] == "disabled"


def test_a_registration_hook_raising_base_exceptions_fails_that_plugin_only(builtin_plugin_manager):
    class Exits:
        @hookimpl
        def skyrl_register_inference_engines(self, register):
            raise SystemExit("bye")

    class Interrupts:
        @hookimpl
        def skyrl_register_inference_engines(self, register):
            raise KeyboardInterrupt

    class Healthy:
        @hookimpl
        def skyrl_register_inference_engines(self, register):
            register(InferenceEngineSpec(name="healthy", factory="x:y"))

    pm = builtin_plugin_manager
    for name, plugin in (("exits", Exits()), ("interrupts", Interrupts()), ("healthy", Healthy())):
        pm.register_plugin(plugin, name)
    assert pm.registry.names("inference_engine") == ["healthy"]
    assert pm.infos["exits"].status == "failed" and "SystemExit: bye" in pm.infos["exits"].error
    assert pm.infos["interrupts"].status == "failed" and "KeyboardInterrupt" in pm.infos["interrupts"].error
