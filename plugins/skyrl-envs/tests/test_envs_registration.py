import sqlite3
import subprocess
import sys
from contextlib import closing

import pytest

import skyrl_core
from skyrl_core.plugins.manager import get_plugin_manager
from skyrl_envs import build_data
from skyrl_envs.plugin import ENVIRONMENTS

NAMES = ["arithmetic", "code", "gsm8k", "math", "multi_tool", "search", "sql"]


def test_every_environment_is_registered_with_its_options():
    registry = get_plugin_manager().registry
    for name in NAMES:
        spec = registry.get("environment", name)
        assert spec.load_options_class().__name__.endswith("Options")
        assert callable(spec.load_factory()) and spec.description
    assert sorted(name for name, *_ in ENVIRONMENTS) == NAMES


def test_the_plugin_module_imports_nothing_heavy():
    code = ("import sys, skyrl_envs.plugin\n"
            "print([m for m in ('torch', 'sqlite3', 'skyrl_envs.sql_env', 'skyrl_envs.sandbox', 'sympy') if m in sys.modules])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True).stdout
    assert out.strip() == "[]"


def test_make_env_builds_each_environment_and_validates_options():
    for name in NAMES:
        env = skyrl_core.make_env(name)
        assert hasattr(env, "reset") and hasattr(env, "step")
    assert skyrl_core.make_env("gsm8k", max_turns=3).options.max_turns == 3
    with pytest.raises(Exception, match="max_turns"):
        skyrl_core.make_env("gsm8k", max_turns=0)
    with pytest.raises(Exception, match="operations"):
        skyrl_core.make_env("arithmetic", operations=["^"])


def test_shipped_data_is_what_the_builders_make(tmp_path):
    rebuilt = build_data.build_all(tmp_path)
    for path in rebuilt:
        shipped = build_data.DATA_DIR / path.relative_to(tmp_path)
        if path.suffix == ".sqlite":  # compare content, not bytes (they depend on the SQLite version)
            dumps = []
            for database in (path, shipped):
                with closing(sqlite3.connect(database)) as connection:
                    dumps.append(list(connection.iterdump()))
            assert dumps[0] == dumps[1]
        else:
            assert path.read_text() == shipped.read_text(), path.name
