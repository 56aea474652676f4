"""Checkpoint directories: atomic, found by run directory or by path, refused when wrong."""

from __future__ import annotations

import json
import os

import pytest

from skyrl_core.trainer import checkpoint as ckpt


class FakeBackendState:
    """Only the checkpoint calls of a backend: writes/reads one file (the trainer owns the rest)."""

    def __init__(self, fail: bool = False) -> None:
        self.fail = fail
        self.loaded: str | None = None

    def save_checkpoint(self, path: str) -> None:
        os.makedirs(path)
        with open(os.path.join(path, "weights"), "w") as f:
            f.write("w")
        if self.fail:
            raise RuntimeError("disk full")

    def load_checkpoint(self, path: str) -> None:
        self.loaded = path


def test_latest_checkpoint_is_found_from_the_run_directory(tmp_path) -> None:
    for step in (2, 4):
        ckpt.save_checkpoint(str(tmp_path), step, FakeBackendState(), {"sampler": {"epoch": 0, "position": step}})
    latest = ckpt.resolve_checkpoint(str(tmp_path))
    assert latest.endswith("step_000004")
    assert ckpt.resolve_checkpoint(str(tmp_path / "checkpoints")) == latest
    assert ckpt.resolve_checkpoint(str(tmp_path / "checkpoints" / "step_000002")).endswith("step_000002")
    backend = FakeBackendState()
    state = ckpt.load_checkpoint(latest, backend)
    assert state["step"] == 4 and state["sampler"]["position"] == 4
    assert backend.loaded == os.path.join(latest, "backend")


def test_a_failed_checkpoint_leaves_the_previous_one_latest(tmp_path) -> None:
    ckpt.save_checkpoint(str(tmp_path), 2, FakeBackendState(), {})
    with pytest.raises(RuntimeError, match="disk full"):
        ckpt.save_checkpoint(str(tmp_path), 4, FakeBackendState(fail=True), {})
    assert sorted(os.listdir(tmp_path / "checkpoints")) == ["latest", "step_000002"]  # no half-written step_4
    assert ckpt.resolve_checkpoint(str(tmp_path)).endswith("step_000002")


def test_wrong_resume_path_is_refused_clearly(tmp_path) -> None:
    with pytest.raises(FileNotFoundError, match="neither a checkpoint .* nor a run directory"):
        ckpt.resolve_checkpoint(str(tmp_path))
    ckpt.save_checkpoint(str(tmp_path), 1, FakeBackendState(), {})
    state_file = tmp_path / "checkpoints" / "step_000001" / "trainer_state.json"
    state_file.write_text(json.dumps({"format": 99, "step": 1}))
    with pytest.raises(ValueError, match="format 99"):
        ckpt.load_checkpoint(str(state_file.parent), FakeBackendState())
