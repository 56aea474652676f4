"""Checkpoint -> kill -> resume gives exactly the metrics of an uninterrupted run (fp32, tiny model).
A run ends by saying what it did and where everything went; after a resume, the held-out summary
is about the resumed run (from the checkpoint's step to its last), not the first run. (The summary
was a test of its own, two more tiny runs: these runs print it anyway.)"""

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


def _summary(stdout: str) -> list[str]:
    lines = stdout.splitlines()
    return lines[next(i for i, line in enumerate(lines) if line.startswith("run finished:")):]


@pytest.mark.slow
def test_resume_after_a_kill_reproduces_the_uninterrupted_run(tmp_path) -> None:
    config = write_tiny_config(tmp_path, steps=4, checkpoint_every=2, eval_every=2)
    uninterrupted, crashed = tmp_path / "uninterrupted", tmp_path / "crashed"

    done = _skyrl_train(config, f"trainer.output_dir={uninterrupted}")
    assert done.returncode == 0, done.stderr[-3000:]
    first = _summary(done.stdout)
    assert first[0] == "run finished: steps 1-4"
    assert first[1].startswith("held-out accuracy: ") and first[1].endswith(" at step 4 (16 prompts)")
    assert " at step 0 -> " in first[1]
    assert first[2:] == [f"  run directory:   {uninterrupted}", f"  config:          {uninterrupted}/config.yaml",
                         f"  metrics:         {uninterrupted}/metrics.jsonl", f"  plot:            {uninterrupted}/metrics.png",
                         f"  last checkpoint: {uninterrupted}/checkpoints/step_000004"]

    killed = _skyrl_train(config, f"trainer.output_dir={crashed}", kill_at=2)
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
    assert [r["step"] for r in read_metrics(str(crashed))] == [0, 1, 2]
    assert (crashed / "checkpoints" / "latest").read_text().strip() == "step_000002"

    resumed = _skyrl_train(config, f"trainer.output_dir={crashed}", f"resume={crashed}")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    summary = _summary(resumed.stdout)
    assert summary[0] == "run finished: steps 3-4 (resumed from step 2)"
    # from the checkpoint's evaluation (step 2) to this run's last (step 4), on this run's 16 prompts
    assert " at step 2 -> " in summary[1] and summary[1].endswith(" at step 4 (16 prompts)"), summary[1]
    assert summary[-1] == f"  last checkpoint: {crashed}/checkpoints/step_000004"

    reference = [without_timings(r) for r in read_metrics(str(uninterrupted))]
    continued = [without_timings(r) for r in read_metrics(str(crashed))]
    assert [r["step"] for r in continued] == [0, 1, 2, 3, 4]
    # every value, bit for bit: rewards, losses, grad norms, mismatch, eval accuracy after the resume
    assert continued == reference
    assert reference[3]["loss"] != reference[4]["loss"]  # the steps after the resume really trained
    assert "eval/accuracy" in continued[4]
