"""The worked example of docs/writing_plugins.md, installed for real: its code is the doc's code."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import FIXTURES, REPO, run_skyrl

PACKAGE = FIXTURES / "skyrl-clipped-reinforce"


@pytest.fixture(scope="module")
def installed_example_plugin():
    pip = [sys.executable, "-m", "pip", "-q"]
    subprocess.run([*pip, "install", "--no-deps", "--no-build-isolation", str(PACKAGE)], check=True,
                   capture_output=True, timeout=300)
    import importlib

    importlib.invalidate_caches()
    yield
    subprocess.run([*pip, "uninstall", "-y", "skyrl-clipped-reinforce"], capture_output=True, timeout=300)
    importlib.invalidate_caches()


def test_doc_code_is_the_fixture_code():
    """Every file of the package is in the doc, as it is in the fixture that is installed."""
    doc = (REPO / "docs" / "writing_plugins.md").read_text()
    (pyproject,) = re.findall(r"```toml\n(.*?)```", doc, flags=re.S)
    assert pyproject == (PACKAGE / "pyproject.toml").read_text()
    blocks = re.findall(r"```python\n(.*?)```", doc, flags=re.S)
    assert blocks[0] == (PACKAGE / "skyrl_clipped_reinforce" / "__init__.py").read_text()
    assert blocks[1] == (PACKAGE / "skyrl_clipped_reinforce" / "plugin.py").read_text()
    assert blocks[2] == (PACKAGE / "skyrl_clipped_reinforce" / "loss.py").read_text()


def test_example_plugin_is_listed_and_selectable_from_config(installed_example_plugin, tmp_path):
    rows = {r["name"]: r for r in json.loads(run_skyrl("plugins", "list", "--json").stdout)}
    row = rows["clipped-reinforce"]
    assert (row["distribution"], row["status"], row["provides"]) == (
        "skyrl-clipped-reinforce", "ok", ["policy_loss:clipped_reinforce"])

    config = tmp_path / "c.yaml"
    config.write_text("model: {config: {model_type: qwen3}}\nalgorithm: {policy_loss: {name: clipped_reinforce, options: {clip: 0.5}}}\n")
    shown = run_skyrl("config", "show", str(config), "--json", "--skip-checks")  # keys and values only: no data here
    assert shown.returncode == 0, shown.stderr
    assert json.loads(shown.stdout)["algorithm"]["policy_loss"] == {"name": "clipped_reinforce", "options": {"clip": 0.5}}

    bad = run_skyrl("config", "show", str(config), "algorithm.policy_loss.options.clip=-1")
    assert bad.returncode == 2
    assert "algorithm.policy_loss.options.clip: -1 is invalid: must be > 0" in bad.stderr


def test_example_loss_computes_through_the_public_loader(installed_example_plugin):
    code = (
        "import torch, skyrl_core\n"
        "loss = skyrl_core.load_policy_loss('clipped_reinforce', clip=0.5)\n"
        "lp = torch.tensor([[-1.0, -2.0]], requires_grad=True)\n"
        "value, metrics = loss(lp, lp.detach(), torch.tensor([[2.0, -0.25]]), torch.tensor([[1.0, 1.0]]))\n"
        "print(round(float(value), 6), metrics['adv_clipped_frac'])\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=REPO)
    assert out.returncode == 0, out.stderr
    # (-(0.5 * -1) - (-0.25 * -2)) / 2 = (0.5 - 0.5) / 2 = 0.0 ; one of two advantages clipped
    assert out.stdout.split() == ["0.0", "0.5"]
