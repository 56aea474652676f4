"""Stage directories and cgroups of sandboxes, named by their owner so leftovers can be found.

A run's stage directory (``$TMPDIR/skyrl-sandbox-<pid namespace>-<pid>-<start time>-<random>``) and
its cgroups carry the same name. A caller killed with SIGKILL cannot remove them; the next process
that runs a sandbox removes every one whose owner is gone: same pid namespace (a pid means nothing
in another), and no live process with that pid and that start time (a reused pid does not keep a
leftover alive). A live owner's sandboxes are never touched.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import threading
from pathlib import Path

from skyrl_envs.sandbox.cgroup import kill_members_and_remove, cgroup_parents

PREFIX = "skyrl-sandbox-"
_cleaned_once = threading.Lock()
_cleaned = False


def _pid_namespace() -> int:
    return os.stat("/proc/self/ns/pid").st_ino


def _start_time(pid: int) -> int | None:
    """Clock ticks after boot at which ``pid`` started, None when no such process lives."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return int(stat.rsplit(")", 1)[1].split()[19])


def owner_prefix(pid: int | None = None) -> str:
    pid = os.getpid() if pid is None else pid
    return f"{PREFIX}{_pid_namespace()}-{pid}-{_start_time(pid)}-"


def new_stage_dir() -> Path:
    """A fresh stage directory owned by this process."""
    return Path(tempfile.mkdtemp(prefix=owner_prefix()))


def stage_dirs_of(pid: int) -> list[Path]:
    """The stage directories of process ``pid`` (alive or not) of our pid namespace."""
    namespace = f"{PREFIX}{_pid_namespace()}-{pid}-"
    return sorted(p for p in Path(tempfile.gettempdir()).glob(f"{namespace}*") if p.is_dir())


def _is_stale(name: str, namespace: int) -> bool:
    parts = name[len(PREFIX):].split("-")
    if len(parts) != 4 or not all(part.isdigit() for part in parts[:3]) or int(parts[0]) != namespace:
        return False  # not ours to judge: another pid namespace, or not this naming at all
    return _start_time(int(parts[1])) != int(parts[2])


def remove_stale_sandboxes() -> list[Path]:
    """Remove the stage directories and cgroups of sandboxes whose owner is gone; return them."""
    namespace = _pid_namespace()
    removed = []
    for path in Path(tempfile.gettempdir()).glob(f"{PREFIX}*"):
        if path.is_dir() and _is_stale(path.name, namespace):
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
    for parent in set((cgroup_parents() or {}).values()):
        for path in parent.glob(f"{PREFIX}*"):
            if path.is_dir() and _is_stale(path.name, namespace) and kill_members_and_remove(path):
                removed.append(path)
    return removed


def remove_stale_sandboxes_once() -> None:
    """``remove_stale_sandboxes`` at the first sandbox run of this process."""
    global _cleaned
    with _cleaned_once:
        if not _cleaned:
            _cleaned = True
            remove_stale_sandboxes()
