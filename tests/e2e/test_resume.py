"""Checkpoint -> kill -> resume gives exactly the metrics of an uninterrupted run (fp32, tiny model)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from skyrl_core.trainer.metrics import read_metrics, without_timings
from tests.e2e.tiny_run import write_tiny_config

ROOT = Path(__file__).resolve().parents[2]


def _skyrl_train(config: Path, *overrides: str, kill_at: int | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("SKYRL_TEST_KILL_AT_CHECKPOINT", None)
    if kill_at is not None:
        env["SKYRL_TEST_KILL_AT_CHECKPOINT"] = str(kill_at)
    return subprocess.run([sys.executable, "-m", "tests.e2e.tiny_run", str(config), *overrides],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)


@pytest.mark.slow
def test_resume_after_a_kill_reproduces_the_uninterrupted_run(tmp_path) -> None:
    config = write_tiny_config(tmp_path, steps=4, checkpoint_every=2, eval_every=2)
    uninterrupted, crashed = tmp_path / "uninterrupted", tmp_path / "crashed"

    done = _skyrl_train(config, f"trainer.output_dir={uninterrupted}")
    assert done.returncode == 0, done.stderr[-3000:]

    killed = _skyrl_train(config, f"trainer.output_dir={crashed}", kill_at=2)
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
    assert [r["step"] for r in read_metrics(str(crashed))] == [0, 1, 2]
    assert (crashed / "checkpoints" / "latest").read_text().strip() == "step_000002"

    resumed = _skyrl_train(config, f"trainer.output_dir={crashed}", f"resume={crashed}")
    assert resumed.returncode == 0, resumed.stderr[-3000:]

    reference = [without_timings(r) for r in read_metrics(str(uninterrupted))]
    continued = [without_timings(r) for r in read_metrics(str(crashed))]
    assert [r["step"] for r in continued] == [0, 1, 2, 3, 4]
    # every value, bit for bit: rewards, losses, grad norms, mismatch, eval accuracy after the resume
    assert continued == reference
    assert reference[3]["loss"] != reference[4]["loss"]  # the steps after the resume really trained
    assert "eval/accuracy" in continued[4]
