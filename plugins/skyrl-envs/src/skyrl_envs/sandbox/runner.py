"""Run an untrusted Python program in a sandbox and collect what it printed.

``run_python(program, stdin, limits)`` starts ``launcher.py`` (see its docstring for the
isolation it builds) in a new session, feeds stdin, reads stdout and stderr up to a cap, and
kills the launcher's process group when the wall-clock limit or the output cap is hit; killing
the launcher kills the sandbox's whole pid namespace. It is thread-safe (no ``preexec_fn``).

If this machine cannot build the sandbox (no namespaces, no ``mount_setattr``, ...),
``SandboxUnavailable`` is raised with the reason: the program is never run without isolation.
A program that the sandbox cannot hold (not valid UTF-8, larger than ``disk_bytes``) is the
program's failure, never an exception: the result says why in ``rejected``.

The whole sandbox's memory is bounded by ``total_memory_bytes``: by a memory cgroup where this
machine lets the caller make one (``cgroup.py``), else by capping each process's address space at
``total_memory_bytes / processes`` (``RLIMIT_NPROC`` counts the processes; the seccomp filter keeps
the program from making a user namespace, which is what mounting a RAM-backed file system needs).
"""

from __future__ import annotations

import glob
import json
import os
import selectors
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import attrs

from skyrl_core.tools import ToolUnavailable
from skyrl_envs.sandbox import stale
from skyrl_envs.sandbox.cgroup import make_cgroups
from skyrl_envs.sandbox.limits import SandboxLimits

LAUNCHER = str(Path(__file__).with_name("launcher.py"))
# The only variables the program sees (no secrets of the caller's environment get through).
PROGRAM_ENV = {
    "PATH": "/usr/local/bin:/usr/bin:/bin",
    "HOME": "/tmp",
    "TMPDIR": "/tmp",
    "LANG": "C.UTF-8",
    "LC_ALL": "C.UTF-8",
    "OMP_NUM_THREADS": "1",
    "OPENBLAS_NUM_THREADS": "1",
}
KILL_GRACE_SECONDS = 2.0  # after a kill, how long to wait for the pipes to close
MIN_PROCESS_MEMORY = 64 * 1024 * 1024  # address space Python needs to start and run a few threads


class SandboxUnavailable(ToolUnavailable):
    """The sandbox cannot be built on this machine; the program was not run."""


@attrs.frozen(kw_only=True)
class SandboxResult:
    """How a sandboxed run ended. ``exit_code`` is None when the program died of ``signal`` or
    was ``rejected`` (the reason it could not be started; empty when it was)."""

    stdout: str
    stderr: str
    exit_code: int | None
    signal: int | None
    timed_out: bool
    output_truncated: bool
    wall_seconds: float
    rejected: str = ""
    memory_bound: str = ""  # "cgroup" or "address_space": how total_memory_bytes was enforced

    @property
    def ok(self) -> bool:
        """Exited 0 within every limit."""
        return self.exit_code == 0 and not self.timed_out and not self.output_truncated and not self.rejected


def _rejected(reason: str) -> SandboxResult:
    return SandboxResult(stdout="", stderr="", exit_code=None, signal=None, timed_out=False, output_truncated=False,
                         wall_seconds=0.0, rejected=reason)


def run_python(program: str, stdin: str = "", limits: SandboxLimits = SandboxLimits(), *,
               python: str | None = None) -> SandboxResult:
    """Run ``program`` (Python source) as ``/tmp/main.py`` in a fresh sandbox, ``stdin`` on stdin."""
    # The base interpreter, not the venv's: the program needs only the stdlib, and a venv may live
    # under /tmp (a CI clone), which the sandbox replaces with its private tmpfs.
    python = python or os.path.realpath(sys.executable)
    reason = _unrunnable(program, limits)
    if reason:
        return _rejected(reason)
    stdin_bytes = stdin.encode("utf-8", errors="surrogateescape")  # test data: bytes as given
    stale.remove_stale_sandboxes_once()
    stage = stale.new_stage_dir()
    cgroups = make_cgroups(stage.name, limits.total_memory_bytes, limits.processes)
    status_read, status_write = os.pipe()
    process: subprocess.Popen | None = None
    streams: _Streams | None = None
    try:
        config = _launcher_config(program, python, limits, stage, cgroups)
        Path(stage, "config.json").write_text(json.dumps(config), encoding="utf-8")
        started = time.monotonic()
        process = subprocess.Popen(
            [sys.executable, "-I", "-S", LAUNCHER, stage, str(status_write)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            pass_fds=(status_write,), env={"PATH": PROGRAM_ENV["PATH"]}, cwd="/",
            start_new_session=True,
        )
        os.close(status_write)
        status_write = -1
        streams = _Streams(process, status_read, stdin_bytes, limits.output_bytes)
        timed_out = not streams.pump(deadline=started + limits.wall_seconds)
        if timed_out or streams.truncated:
            _kill_group(process.pid)
            streams.pump(deadline=time.monotonic() + KILL_GRACE_SECONDS)
        process.wait()
        wall_seconds = time.monotonic() - started
        statuses = [json.loads(line) for line in streams.status.decode().splitlines() if line.strip()]
    finally:
        if process is not None and process.poll() is None:  # an error of ours: leave nothing running
            _kill_group(process.pid)
            process.wait()
        if streams is not None:
            streams.close()
        elif process is not None:
            for pipe in (process.stdin, process.stdout, process.stderr):
                pipe.close()
        for fd in (status_read, status_write):
            if fd >= 0:
                os.close(fd)
        if cgroups is not None:
            cgroups.remove()
        shutil.rmtree(stage, ignore_errors=True)
    errors = [s["error"] for s in statuses if "error" in s]
    if errors:
        raise SandboxUnavailable(f"cannot build the code sandbox on this machine: {errors[0]}")
    rejections = [s["rejected"] for s in statuses if "rejected" in s]
    if rejections:
        return _rejected(rejections[0])
    ending = next((s for s in statuses if "exit_code" in s or "signal" in s), {})
    if not ending and not (timed_out or streams.truncated):
        raise SandboxUnavailable(
            f"the sandbox launcher ended without reporting (exit status {process.returncode}): "
            f"{streams.stderr.decode(errors='replace')[-500:]}"
        )
    return SandboxResult(
        stdout=streams.stdout.decode("utf-8", errors="replace"),
        stderr=streams.stderr.decode("utf-8", errors="replace"),
        exit_code=ending.get("exit_code"),
        signal=ending.get("signal", signal.SIGKILL if not ending else None),
        timed_out=timed_out,
        output_truncated=streams.truncated,
        wall_seconds=wall_seconds,
        memory_bound="cgroup" if cgroups is not None else "address_space",
    )


def _unrunnable(program: str, limits: SandboxLimits) -> str:
    """Why ``program`` cannot even be placed in the sandbox ('' when it can)."""
    try:
        size = len(program.encode("utf-8"))
    except UnicodeEncodeError as error:
        return f"the program is not valid UTF-8 text ({error.reason} at character {error.start})"
    if size > limits.disk_bytes:
        return f"the program is larger than the sandbox allows ({size} bytes)"
    return ""


def visible_paths(python: str, limits: SandboxLimits) -> tuple[list[str], list[str], list[str]]:
    """(host paths shown read-only inside, the interpreter's directories not among them, the
    site-packages directories under either, covered empty)."""
    interpreter = {os.path.realpath(p) for p in (sys.base_prefix, os.path.dirname(os.path.realpath(python)))}
    shown = [p for p in limits.visible_paths if os.path.lexists(p)]
    shown_real = [os.path.realpath(p) for p in shown]
    extra = sorted(p for p in interpreter if not any(p == v or p.startswith(v.rstrip("/") + "/") for v in shown_real))
    covered = set()
    for root in (shown + extra) if not limits.site_packages else ():
        for pattern in ("lib/python3*/site-packages", "lib/python3*/dist-packages", "lib/python3/dist-packages",
                        "local/lib/python3*/*-packages", "lib64/python3*/site-packages"):
            covered.update(os.path.realpath(p) for p in glob.glob(os.path.join(root, pattern)))
    return shown, extra, sorted(covered)


def _launcher_config(program: str, python: str, limits: SandboxLimits, stage: Path, cgroups) -> dict:
    shown, interpreter, covered = visible_paths(python, limits)
    memory_bytes = limits.memory_bytes
    if cgroups is None:  # no cgroup to bound the sum: bound each of the processes by its share
        share = limits.total_memory_bytes // limits.processes
        if share < min(memory_bytes, MIN_PROCESS_MEMORY):
            raise SandboxUnavailable(
                f"this machine gives the sandbox no memory cgroup, so each process gets total_memory_bytes / "
                f"processes = {share} bytes, less than Python needs ({MIN_PROCESS_MEMORY}); raise "
                f"sandbox.total_memory_bytes or lower sandbox.processes")
        memory_bytes = min(memory_bytes, share)
    return {
        "program": program,
        "python": python,
        "env": PROGRAM_ENV,
        "caller_pid": os.getpid(),
        "uid_base": limits.uid_base,
        "new_root": str(stage),
        "visible_paths": shown,
        "interpreter_paths": interpreter,
        "covered_paths": covered,
        "cgroup_procs": cgroups.procs_files if cgroups is not None else [],
        "tmpfs_bytes": limits.disk_bytes,
        "max_files": limits.max_files,
        "nproc_baseline": 0 if os.geteuid() == 0 else _processes_of_this_user(),
        "limits": {
            "cpu_seconds": limits.cpu_seconds,
            "memory_bytes": memory_bytes,
            "processes": limits.processes,
            "file_size_bytes": limits.file_size_bytes,
            "open_files": limits.open_files,
        },
    }


def _processes_of_this_user() -> int:
    """Processes of our real uid now: RLIMIT_NPROC counts them too when we are not root."""
    uid, count = os.getuid(), 0
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                count += os.stat(f"/proc/{entry}").st_uid == uid
            except OSError:
                pass
    return count


def _kill_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


class _Streams:
    """Feeds stdin and collects stdout, stderr and the status pipe without blocking."""

    def __init__(self, process: subprocess.Popen, status_fd: int, stdin: bytes, cap: int):
        self.stdout = b""
        self.stderr = b""
        self.status = b""
        self.truncated = False
        self._cap = cap
        self._stdin = memoryview(stdin)
        self._process = process
        self._selector = selectors.DefaultSelector()
        for name, stream in (("stdout", process.stdout), ("stderr", process.stderr)):
            os.set_blocking(stream.fileno(), False)
            self._selector.register(stream.fileno(), selectors.EVENT_READ, name)
        self._selector.register(status_fd, selectors.EVENT_READ, "status")
        self._stdin_fd = process.stdin.fileno()
        os.set_blocking(self._stdin_fd, False)
        self._selector.register(self._stdin_fd, selectors.EVENT_WRITE, "stdin")
        if not stdin:
            self._close_stdin()

    def pump(self, deadline: float) -> bool:
        """Move bytes until every pipe is closed (True) or ``deadline`` passes (False).

        Stops early (returning True) once an output stream exceeds the cap; ``truncated`` says so.
        """
        while self._selector.get_map():
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return False
            for key, _ in self._selector.select(timeout=remaining):
                if key.data == "stdin":
                    self._write_stdin()
                else:
                    self._read(key)
            if self.truncated:
                return True
        return True

    def close(self) -> None:
        """Close the selector and our ends of the program's pipes (not the status fd: the caller's)."""
        self._selector.close()
        for stream in (self._process.stdin, self._process.stdout, self._process.stderr):
            stream.close()

    def _write_stdin(self) -> None:
        try:
            written = os.write(self._stdin_fd, self._stdin[:65536])
        except BlockingIOError:
            return
        except BrokenPipeError:  # the program stopped reading: it does not get the rest
            self._close_stdin()
            return
        self._stdin = self._stdin[written:]
        if not self._stdin:
            self._close_stdin()

    def _close_stdin(self) -> None:
        if self._stdin_fd in self._selector.get_map():
            self._selector.unregister(self._stdin_fd)
        self._process.stdin.close()

    def _read(self, key: selectors.SelectorKey) -> None:
        try:
            chunk = os.read(key.fd, 65536)
        except BlockingIOError:
            return
        if not chunk:
            self._selector.unregister(key.fd)
            return
        if key.data == "status":
            self.status += chunk
            return
        collected = getattr(self, key.data) + chunk
        if len(collected) > self._cap:
            collected = collected[: self._cap]
            self.truncated = True
        setattr(self, key.data, collected)
