"""The sandbox's cgroups: one memory and one pids cgroup per run, so limits hold for the whole tree.

``RLIMIT_AS`` bounds each process, not their sum; a memory cgroup bounds everything the sandbox's
processes charge (their pages, tmpfs files, pipe and socket buffers, SysV segments) together, and
a pids cgroup counts every process and thread. The caller makes them (as a child of its own cgroup,
cgroup v2 with the memory controller delegated, else cgroup v1) before starting the launcher, the
program joins them, and the caller removes them after the run (killing whatever is left).
``make_cgroups`` returns None where this machine does not let us (no cgroup file system, not
writable, controllers not delegated); the runner then splits the budget over the processes.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

REMOVE_SECONDS = 2.0  # how long a run's end waits for its cgroups to empty


class SandboxCgroups:
    """The cgroup directories of one run."""

    def __init__(self, directories: list[Path]):
        self.directories = directories

    @property
    def procs_files(self) -> list[str]:
        return [str(d / "cgroup.procs") for d in self.directories]

    def remove(self) -> bool:
        """Kill what is left in them and remove them; False when one is still busy after a while."""
        deadline = time.monotonic() + REMOVE_SECONDS
        remaining = list(self.directories)
        while remaining:
            for directory in list(remaining):
                if kill_members_and_remove(directory):
                    remaining.remove(directory)
            if not remaining or time.monotonic() > deadline:
                break
            time.sleep(0.02)
        return not remaining


def kill_members_and_remove(directory: Path) -> bool:
    try:
        members = (directory / "cgroup.procs").read_text().split()
    except FileNotFoundError:
        return True
    except OSError:
        members = []
    for pid in members:
        try:
            os.kill(int(pid), signal.SIGKILL)
        except (ProcessLookupError, PermissionError, ValueError):
            pass
    # A killed member leaves the cgroup only once the kernel has torn it down: until then rmdir
    # fails with EBUSY, so retry for a short while instead of leaving the cgroup behind.
    deadline = time.monotonic() + 5.0
    while True:
        try:
            directory.rmdir()
            return True
        except FileNotFoundError:
            return True
        except OSError:
            if time.monotonic() > deadline:
                return False
            time.sleep(0.05)


def _mounts() -> list[tuple[str, str, set[str]]]:
    """(mount point, file system type, super options) of every cgroup mount of this process."""
    found = []
    try:
        lines = Path("/proc/self/mountinfo").read_text().splitlines()
    except OSError:
        return found
    for line in lines:
        fields = line.split()
        separator = fields.index("-")
        fstype, options = fields[separator + 1], fields[separator + 3].split(",")
        if fstype in ("cgroup", "cgroup2") and fields[3] == "/":
            found.append((fields[4].replace("\\040", " "), fstype, set(options)))
    return found


def _own_paths() -> dict[str, str]:
    """This process's cgroup path per v1 controller, and under ``""`` its cgroup v2 path."""
    paths = {}
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        return paths
    for line in lines:
        _, controllers, path = line.split(":", 2)
        for controller in controllers.split(",") if controllers else [""]:
            paths[controller] = path
    return paths


def cgroup_parents() -> dict[str, Path] | None:
    """Where this process may make the sandbox's memory and pids cgroups, or None.

    ``{"memory": dir, "pids": dir}`` (one directory for both on cgroup v2, where ``pids`` is
    optional), each writable and with the controller available to children.
    """
    own = _own_paths()
    for mount_point, fstype, options in _mounts():
        if fstype != "cgroup2" or "" not in own:
            continue
        parent = Path(mount_point + own[""])
        try:
            delegated = set((parent / "cgroup.subtree_control").read_text().split())
        except OSError:
            continue
        if "memory" in delegated and os.access(parent, os.W_OK):
            return {"memory": parent, **({"pids": parent} if "pids" in delegated else {})}
    parents = {}
    for mount_point, fstype, options in _mounts():
        for controller in ("memory", "pids"):
            if fstype == "cgroup" and controller in options and controller in own:
                parent = Path(mount_point + own[controller])
                if os.access(parent, os.W_OK):
                    parents[controller] = parent
    return parents if "memory" in parents else None


def make_cgroups(name: str, memory_bytes: int, processes: int) -> SandboxCgroups | None:
    """Fresh cgroups called ``name`` limiting memory (no swap) and processes, or None."""
    parents = cgroup_parents()
    if parents is None:
        return None
    made: list[Path] = []
    try:
        for controller, parent in parents.items():
            directory = parent / name
            if directory not in made:
                directory.mkdir()
                made.append(directory)
            _write_limits(directory, controller, memory_bytes, processes)
    except OSError:
        SandboxCgroups(made).remove()
        return None
    return SandboxCgroups(made)


def _write_limits(directory: Path, controller: str, memory_bytes: int, processes: int) -> None:
    v2 = (directory / "cgroup.controllers").exists()
    if controller == "pids":
        (directory / "pids.max").write_text(str(processes))
    elif v2:
        (directory / "memory.max").write_text(str(memory_bytes))
        if (directory / "memory.swap.max").exists():
            (directory / "memory.swap.max").write_text("0")
        (directory / "memory.oom.group").write_text("1")
    else:
        (directory / "memory.limit_in_bytes").write_text(str(memory_bytes))
        if (directory / "memory.memsw.limit_in_bytes").exists():
            (directory / "memory.memsw.limit_in_bytes").write_text(str(memory_bytes))
