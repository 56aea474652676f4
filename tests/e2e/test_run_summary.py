"""A run ends by saying what it did and where everything went; after a resume, the held-out
summary is about the resumed run (from the checkpoint's step to its last), not the first run."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.e2e.tiny_run import write_tiny_config

ROOT = Path(__file__).resolve().parents[2]


def _train(config: Path, *overrides: str) -> str:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-m", "tests.e2e.tiny_run", str(config), *overrides],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


def _summary(stdout: str) -> list[str]:
    lines = stdout.splitlines()
    return lines[next(i for i, line in enumerate(lines) if line.startswith("run finished:")):]


@pytest.mark.slow
def test_the_end_of_a_run_and_of_its_resume_say_where_everything_went(tmp_path) -> None:
    config = write_tiny_config(tmp_path, steps=2, eval_every=1)
    run = tmp_path / "run"
    first = _summary(_train(config))
    assert first[0] == "run finished: steps 1-2"
    assert first[1].startswith("held-out accuracy: ") and first[1].endswith(" at step 2 (16 prompts)")
    assert " at step 0 -> " in first[1]
    assert first[2:] == [f"  run directory:   {run}", f"  config:          {run}/config.yaml",
                         f"  metrics:         {run}/metrics.jsonl", f"  plot:            {run}/metrics.png",
                         f"  last checkpoint: {run}/checkpoints/step_000002"]

    resumed = _summary(_train(config, "trainer.steps=3", f"resume={run}"))
    assert resumed[0] == "run finished: steps 3-3 (resumed from step 2)"
    # from the checkpoint's evaluation (step 2) to this run's last (step 3), on this run's 16 prompts
    assert " at step 2 -> " in resumed[1] and resumed[1].endswith(" at step 3 (16 prompts)"), resumed[1]
    assert resumed[-1] == f"  last checkpoint: {run}/checkpoints/step_000003"
