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


def test_the_new_copy_is_on_disk_before_its_rename_and_the_rename_after(tmp_path, monkeypatch):
    """Every file and directory of the new copy is fsynced before it is renamed into place, and
    the parent (the renames) after: a record written once publish returns cannot point at files a
    power cut lost."""
    target, new = tmp_path / "step", tmp_path / "step.partial"
    _write(target, "old")
    _write(new / "shards", "new")
    (new / "meta.json").write_text("{}")
    events = []
    real_fsync, real_replace = os.fsync, os.replace
    monkeypatch.setattr(directories.os, "fsync", lambda fd: events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}"))) or real_fsync(fd))
    monkeypatch.setattr(directories.os, "replace", lambda a, b: events.append(("replace", str(a))) or real_replace(a, b))
    publish_directory(str(new), str(target))
    synced = [path for kind, path in events if kind == "fsync"]
    renamed = events.index(("replace", str(new)))
    before = {path for kind, path in events[:renamed] if kind == "fsync"}
    assert before == {str(new / "shards" / "weights.safetensors"), str(new / "shards"), str(new / "meta.json"), str(new)}
    assert synced.index(str(new / "shards" / "weights.safetensors")) < synced.index(str(new / "shards")) < synced.index(str(new))
    assert events[renamed + 1:] == [("fsync", str(tmp_path))]  # the renames, after them
    assert (target / "shards" / "weights.safetensors").read_text() == "new"
