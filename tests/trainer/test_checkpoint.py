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


# --- no pickle, one file-mode policy, temporaries of killed runs ------------------------------------


class _RunsCommand:
    """A pickle payload: unpickling it runs ``touch MARKER``."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_a_tampered_rng_file_is_refused_without_running_it(tmp_path) -> None:
    import torch

    path = ckpt.save_checkpoint(str(tmp_path / "run"), 1, FakeBackendState(), {})
    marker = tmp_path / "code-ran"
    for name in os.listdir(path):
        if name.startswith("rng"):
            torch.save({"python": _RunsCommand(str(marker))}, os.path.join(path, name))  # an attacker's file
    backend = FakeBackendState()
    with pytest.raises(ValueError, match="not a safetensors state file"):
        ckpt.load_checkpoint(path, backend)
    assert not marker.exists()
    assert backend.loaded is None  # refused before the backend changed anything


def test_rng_state_round_trips_exactly(tmp_path) -> None:
    import random

    import numpy as np
    import torch

    random.seed(3), np.random.seed(4), torch.manual_seed(5)
    path = ckpt.save_checkpoint(str(tmp_path), 1, FakeBackendState(), {})
    expected = (random.random(), float(np.random.rand()), torch.rand(3).view(torch.int32).tolist())
    random.seed(0), np.random.seed(0), torch.manual_seed(0)
    ckpt.load_checkpoint(path, FakeBackendState())
    assert (random.random(), float(np.random.rand()), torch.rand(3).view(torch.int32).tolist()) == expected


def test_a_format_1_checkpoint_is_refused_with_its_format(tmp_path) -> None:
    path = ckpt.save_checkpoint(str(tmp_path), 1, FakeBackendState(), {})
    state_file = os.path.join(path, "trainer_state.json")
    with open(state_file) as f:
        state = json.load(f)
    with open(state_file, "w") as f:
        json.dump({**state, "format": 1}, f)
    with pytest.raises(ValueError, match="format 1, this trainer reads format 2 .*pickle"):
        ckpt.load_checkpoint(path, FakeBackendState())


def test_checkpoint_files_get_the_modes_of_ordinary_files(tmp_path) -> None:
    class PrivateFiles(FakeBackendState):
        def save_checkpoint(self, path: str) -> None:
            os.makedirs(path, mode=0o700)
            fd = os.open(os.path.join(path, "weights"), os.O_CREAT | os.O_WRONLY, 0o600)
            os.close(fd)

    previous = os.umask(0o022)
    try:
        path = ckpt.save_checkpoint(str(tmp_path), 1, PrivateFiles(), {})
        os.umask(0o027)
        other = ckpt.save_checkpoint(str(tmp_path), 2, PrivateFiles(), {})
    finally:
        os.umask(previous)
    modes = {os.path.relpath(os.path.join(r, n), path): os.stat(os.path.join(r, n)).st_mode & 0o777
             for r, ds, fs in os.walk(path) for n in ds + fs}
    assert os.stat(path).st_mode & 0o777 == 0o755
    assert modes == {"backend": 0o755, "backend/weights": 0o644, "rng.safetensors": 0o644, "trainer_state.json": 0o644}
    assert os.stat(os.path.join(other, "backend", "weights")).st_mode & 0o777 == 0o640  # the umask is respected
    assert os.stat(other).st_mode & 0o777 == 0o750


def test_a_checkpoint_an_interrupted_overwrite_left_aside_is_put_back(tmp_path) -> None:
    """Re-saving a step moves its old copy aside first; if the process died before the new copy
    arrived, the run's pre-flight clean-up puts the old one back where ``latest`` points."""
    ckpt.save_checkpoint(str(tmp_path), 1, FakeBackendState(), {"marker": "first"})
    root = tmp_path / "checkpoints"
    os.replace(root / "step_000001", root / "step_000001.replaced")  # what the crash leaves
    assert ckpt.remove_stale_temporaries(str(tmp_path)) == []
    assert ckpt.read_trainer_state(ckpt.resolve_checkpoint(str(tmp_path)))["marker"] == "first"
    ckpt.save_checkpoint(str(tmp_path), 1, FakeBackendState(), {"marker": "second"})  # a whole overwrite
    assert ckpt.read_trainer_state(ckpt.resolve_checkpoint(str(tmp_path)))["marker"] == "second"
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step_000001"]


def test_temporaries_of_a_killed_checkpoint_are_removed(tmp_path) -> None:
    ckpt.save_checkpoint(str(tmp_path), 1, FakeBackendState(), {})
    root = tmp_path / "checkpoints"
    left = [root / ".step_000002.tmp-ab_12x", root / ".latest.tmp", tmp_path / ".model.tmp-k9", root / "step_000001.old-0123abcd"]
    for path in left:
        path.mkdir() if "step" in path.name else path.write_text("partial")
    keep = [tmp_path / "notes.txt", root / "step_000001", root / "latest", tmp_path / "checkpoints"]
    (tmp_path / "notes.txt").write_text("mine")
    removed = ckpt.remove_stale_temporaries(str(tmp_path))
    assert sorted(removed) == sorted(map(str, left))
    assert all(not p.exists() for p in left) and all(p.exists() for p in keep)
