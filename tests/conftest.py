from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
FIXTURES = REPO / "tests" / "fixtures"


def run_skyrl(*args: str, env: dict[str, str] | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
    """Run the real ``skyrl`` CLI (``python -m skyrl_core``) in a subprocess."""
    full_env = {**os.environ, **(env or {})}
    return subprocess.run(
        [sys.executable, "-m", "skyrl_core", *args], capture_output=True, text=True, timeout=timeout, env=full_env, cwd=REPO
    )


@pytest.fixture(scope="module")
def third_party_env_packages():
    """Install the fixture packages (one good, one whose import fails) into this venv, and remove them after."""
    names = ["skyrl-example-env", "skyrl-broken-env"]
    pip = [sys.executable, "-m", "pip", "-q"]
    subprocess.run(
        [*pip, "install", "--no-deps", "--no-build-isolation", *(str(FIXTURES / n) for n in names)],
        check=True, capture_output=True, timeout=300,
    )
    import importlib

    importlib.invalidate_caches()
    try:
        yield names
    finally:
        subprocess.run([*pip, "uninstall", "-y", *names], capture_output=True, timeout=300)
        importlib.invalidate_caches()
