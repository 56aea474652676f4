"""Runs a shipped example config in a fresh ``skyrl train`` (or ``skyrl sft``) process started in
another directory, and checks what every example run must do: exit 0, log up to its last step,
and print none of the warnings every run used to print."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import yaml

from skyrl_core.trainer.metrics import read_metrics

# What every run printed before: FSDP2's view warning (the lm_head output was a view, see
# skyrl_core/ops/shapes.py) and megatron-core's import warnings.
NOISE = ("returned a view tensor", "megatron", "Megatron", "Apex")


def example_command(path: Path) -> str:
    """``sft`` for a supervised fine-tuning example (it has an ``sft:`` section), else ``train``."""
    return "sft" if "sft" in yaml.safe_load(path.read_text()) else "train"


def run_example(path: Path, cwd: Path, *overrides: str, steps: int = 1) -> subprocess.CompletedProcess:
    """``skyrl train EXAMPLE`` (or ``skyrl sft``) for ``steps`` steps, from ``cwd``, output in ``cwd/run``."""
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "2")}
    command = [sys.executable, "-m", "skyrl_core", example_command(path), str(path),
               f"trainer.steps={steps}", "data.eval_size=4", "trainer.output_dir=run", *overrides]
    return subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True, timeout=900)


def check_example_run(path: Path, tmp_path: Path, *overrides: str, steps: int = 1) -> subprocess.CompletedProcess:
    """Runs the example (output in ``tmp_path/run``) and checks it; returns the finished process."""
    done = run_example(path, tmp_path, *overrides, steps=steps)
    assert done.returncode == 0, done.stderr[-3000:]
    assert [r["step"] for r in read_metrics(str(tmp_path / "run"))][-1] == steps
    assert "loss" in read_metrics(str(tmp_path / "run"))[-1] or "skipped" in read_metrics(str(tmp_path / "run"))[-1]
    noise = [line for line in done.stderr.splitlines() if any(n in line for n in NOISE)]
    assert noise == []
    assert len(re.findall(r"Loading weights:\s+0%", done.stderr)) <= 1, done.stderr[-3000:]  # bars started
    return done
