"""The public CLI surface (DESIGN.md section 8), run for real in subprocesses."""

from __future__ import annotations

import json
import subprocess
import sys

from tests.conftest import REPO, run_skyrl

PLUGIN_DISTRIBUTIONS = {
    "skyrl-torch", "skyrl-fsdp", "skyrl-megatron", "skyrl-vllm", "skyrl-sglang", "skyrl-isoexec", "skyrl-envs",
}


def test_version_prints_core_then_plugins():
    result = run_skyrl("--version")
    assert result.returncode == 0, result.stderr
    first, second = result.stdout.splitlines()[:2]
    assert first == "skyrl-core 0.1.0"
    assert second.startswith("plugins: ")
    listed = {pair.rsplit("-", 1)[0] for pair in second.removeprefix("plugins: ").split()}
    assert PLUGIN_DISTRIBUTIONS <= listed


def test_plugins_list_json_lists_every_distribution_and_builtins():
    result = run_skyrl("plugins", "list", "--json")
    assert result.returncode == 0, result.stderr
    rows = json.loads(result.stdout)
    for row in rows:
        assert {"name", "version", "kind", "provides", "status"} <= set(row)
    by_dist = {row["distribution"]: row for row in rows if row["kind"] == "plugin"}
    assert PLUGIN_DISTRIBUTIONS <= set(by_dist)
    for dist in PLUGIN_DISTRIBUTIONS:
        assert by_dist[dist]["status"] == "ok", (dist, by_dist[dist]["error"])
        assert by_dist[dist]["version"] == "0.1.0"
    builtins = [row for row in rows if row["kind"] == "builtin"]
    assert {row["name"] for row in builtins} == {"core", "core.algorithms"}
    provided = {item for row in rows for item in row["provides"]}
    for item in ("inference_engine:torch", "training_backend:fsdp", "policy_loss:ppo", "advantage_estimator:grpo",
                 "environment:arithmetic", "inference_engine:vllm", "inference_engine:sglang"):
        assert item in provided


def test_plugins_list_never_imports_heavy_engines():
    code = (
        "import sys, json\n"
        "from skyrl_core.cli.main import main\n"
        "try:\n"
        "    main(['plugins', 'list', '--json'])\n"
        "except SystemExit:\n"
        "    pass\n"
        "heavy = [m for m in ('vllm', 'sglang', 'megatron', 'torch.distributed', 'torch') if m in sys.modules]\n"
        "print('HEAVY=' + json.dumps(heavy), file=sys.stderr)\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=120)
    heavy_line = [line for line in result.stderr.splitlines() if line.startswith("HEAVY=")][-1]
    assert json.loads(heavy_line.removeprefix("HEAVY=")) == []


def test_plugins_list_table_renders():
    result = run_skyrl("plugins", "list")
    assert result.returncode == 0, result.stderr
    assert "skyrl plugins" in result.stdout and "skyrl-fsdp" in result.stdout


def test_python_dash_m_and_help():
    result = run_skyrl("--help")
    assert result.returncode == 0
    for command in ("plugins", "config", "train"):
        assert command in result.stdout
