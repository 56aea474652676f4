"""Replacing a directory with one whole copy on disk at every moment (``skyrl_core.directories``)."""

import os

import pytest

import skyrl_core.directories as directories
from skyrl_core.directories import REPLACED, publish_directory, recover_replaced


def _write(directory, text: str) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "weights.safetensors").write_text(text)


def test_a_crash_between_the_renames_leaves_the_old_copy_aside_and_recovery_puts_it_back(tmp_path, monkeypatch):
    """The old copy is moved aside before the new one takes its place; a crash between the two
    renames (simulated: the second fails) leaves it aside, and ``recover_replaced`` puts it back.
    Replacing by deleting first would have lost both copies at that moment."""
    target, new = tmp_path / "step", tmp_path / ".step.tmp-1"
    _write(target, "old")
    _write(new, "new")
    real_replace = os.replace

    def crash_on_the_second_rename(src, dst):
        if str(src) == str(new):
            raise OSError("killed")
        real_replace(src, dst)

    with monkeypatch.context() as patch:
        patch.setattr(directories.os, "replace", crash_on_the_second_rename)
        with pytest.raises(OSError, match="killed"):
            publish_directory(str(new), str(target))
    assert not target.exists() and (tmp_path / f"step{REPLACED}").is_dir()
    assert recover_replaced(str(target)) == "restored"
    assert (target / "weights.safetensors").read_text() == "old"
    assert recover_replaced(str(target)) is None  # nothing aside any more

    publish_directory(str(new), str(target))  # without a crash: the new copy in place, nothing aside
    assert (target / "weights.safetensors").read_text() == "new"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step"]

    _write(tmp_path / f"step{REPLACED}", "old")  # aside beside a complete new copy: deleted
    assert recover_replaced(str(target)) == "removed"
    assert (target / "weights.safetensors").read_text() == "new"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step"]


def test_publishing_where_nothing_was(tmp_path):
    new = tmp_path / "new"
    _write(new, "only")
    publish_directory(str(new), str(tmp_path / "target"))
    assert (tmp_path / "target" / "weights.safetensors").read_text() == "only"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["target"]
