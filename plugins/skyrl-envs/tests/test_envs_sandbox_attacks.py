"""Hostile programs against the code sandbox: none may succeed, each must end within its limits.

Every attack runs for real through ``run_python``. After each one an autouse fixture checks the
caller is healthy: a sentinel process of ours is alive, no sandbox process is left anywhere, no
file descriptor leaked, and a normal program still runs. Each attack's wall time is asserted
below its limit plus a margin for kill and teardown (a correctness bound, not a benchmark).
"""

from __future__ import annotations

import errno
import hashlib
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
from pathlib import Path

import pytest

from skyrl_envs.sandbox import SandboxLimits, SandboxUnavailable, run_python

MIB = 1024 * 1024
PID_MAX = int(Path("/proc/sys/kernel/pid_max").read_text())
# A uid range of our own (uid = base + launcher pid), so a concurrent test run elsewhere cannot
# be mistaken for a leftover of ours.
UID_BASE = 10_000_000 + random.Random(os.getpid()).randrange(900) * 4_194_304
LIMITS = SandboxLimits(wall_seconds=2.0, cpu_seconds=1, memory_bytes=256 * MIB, processes=8,
                       file_size_bytes=2 * MIB, disk_bytes=4 * MIB, max_files=64, open_files=32,
                       output_bytes=64 * 1024, uid_base=UID_BASE)
MARGIN_SECONDS = 3.0  # kill, namespace teardown and pipe draining on a loaded 2-core machine
ROOT = os.geteuid() == 0


def attack(program: str, stdin: str = "", limits: SandboxLimits = LIMITS):
    started = time.monotonic()
    result = run_python(textwrap.dedent(program), stdin, limits)
    elapsed = time.monotonic() - started
    assert elapsed < limits.wall_seconds + MARGIN_SECONDS, f"the attack ran {elapsed:.1f} s"
    return result


def sandbox_processes() -> list[int]:
    """Live processes running under our sandbox uid range."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            uid_line = next(l for l in Path(f"/proc/{entry}/status").read_text().splitlines() if l.startswith("Uid:"))
        except (OSError, StopIteration):
            continue
        if UID_BASE <= int(uid_line.split()[1]) <= UID_BASE + PID_MAX:
            found.append(int(entry))
    return found


@pytest.fixture(scope="module")
def sentinel():
    """A process of the caller's that attacks try to kill."""
    process = subprocess.Popen(["sleep", "300"])
    yield process
    process.kill()
    process.wait()


@pytest.fixture(autouse=True)
def caller_stays_healthy(sentinel):
    fds_before = sorted(os.listdir("/proc/self/fd"))
    yield
    assert sentinel.poll() is None, "the sentinel process was killed"
    if ROOT:
        deadline = time.monotonic() + 2.0
        while sandbox_processes() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert sandbox_processes() == [], "a sandboxed process outlived its run"
    canary = run_python("print(sum(range(10)))", "", LIMITS)
    assert canary.ok and canary.stdout == "45\n"
    assert sorted(os.listdir("/proc/self/fd")) == fds_before, "file descriptors leaked"


# --- filesystem ---------------------------------------------------------------------------------


@pytest.fixture
def world_writable_dir():
    """A directory anyone may write to on the host, outside the paths the sandbox hides."""
    parent = "/var/cache" if os.access("/var/cache", os.W_OK) else None
    path = Path(tempfile.mkdtemp(prefix="skyrl-attack-", dir=parent))
    path.chmod(0o777)
    yield path
    for child in path.iterdir():
        child.unlink()
    path.rmdir()


# Outside targets the sandboxed program tries; the unsandboxed control tries only the first.
# No system file is ever a target: if the sandbox were broken, the test must fail, not damage the
# machine (a root-owned sentinel file stands in for /etc/passwd).
def outside_targets(world_writable_dir: Path) -> list[str]:
    return [f"{world_writable_dir}/pwned", str(world_writable_dir / "sentinel"), "../pwned", "/var/tmp/skyrl-pwned",
            "/dev/shm/skyrl-pwned", "link"]


def write_outside_program(targets: list[str], world_writable_dir: Path) -> str:
    return f"""
        import os
        os.symlink("{world_writable_dir}/via-link", "link")
        for target in {targets!r}:
            try:
                with open(target, "a") as handle:
                    handle.write("pwned")
                print("WROTE", target)
            except OSError as error:
                print("refused", target, error.errno)
    """


def test_writes_outside_the_private_directory_fail(world_writable_dir):
    sentinel = world_writable_dir / "sentinel"
    sentinel.write_text("root-owned, read-only for others\n")
    sentinel.chmod(0o644)
    sentinel_hash = hashlib.sha256(sentinel.read_bytes()).hexdigest()
    result = attack(write_outside_program(outside_targets(world_writable_dir), world_writable_dir))
    assert result.exit_code == 0, result.stderr
    assert "WROTE" not in result.stdout
    assert result.stdout.count("refused") == 6
    assert [p.name for p in world_writable_dir.iterdir()] == ["sentinel"]
    assert hashlib.sha256(sentinel.read_bytes()).hexdigest() == sentinel_hash
    assert not Path("/var/tmp/skyrl-pwned").exists() and not Path("/dev/shm/skyrl-pwned").exists()


def test_files_under_hidden_directories_are_invisible():
    handle, secret_path = tempfile.mkstemp(dir="/var/tmp")
    os.write(handle, b"host-secret-file")
    os.close(handle)
    os.chmod(secret_path, 0o644)  # readable by anyone on the host: only the sandbox hides it
    try:
        result = attack(f"""
            import os
            for path in ["{secret_path}", "/root/.bashrc"]:
                try:
                    print("READ", open(path).read())
                except OSError as error:
                    print("refused", error.errno)
            print(os.listdir("/var/tmp"), os.listdir("/root") if os.path.isdir("/root") else None)
        """)
    finally:
        os.unlink(secret_path)
    assert "host-secret-file" not in result.stdout and "READ" not in result.stdout
    assert os.path.basename(secret_path) not in result.stdout


def test_disk_filling_stops_at_the_private_quota():
    result = attack("""
        import os
        written = 0
        try:
            for number in range(1000):
                with open(f"fill{number}", "wb") as handle:
                    for _ in range(4):
                        handle.write(b"x" * 262144)
                        handle.flush()
                        written += 262144
        except OSError as error:
            print("stopped", error.errno, written)
    """)
    word, code, written = result.stdout.split()
    assert word == "stopped" and int(code) in (errno.ENOSPC, errno.EFBIG)
    assert int(written) <= LIMITS.disk_bytes


def test_a_single_huge_file_stops_at_the_file_size_limit():
    result = attack("""
        try:
            with open("big", "wb") as handle:
                handle.write(b"x" * (3 * 1024 * 1024))
        except OSError as error:
            print("stopped", error.errno)
    """)
    assert result.stdout.split() == ["stopped", str(errno.EFBIG)]


def test_inode_exhaustion_stops_at_the_file_count_limit():
    result = attack("""
        count = 0
        try:
            while True:
                open(f"f{count}", "w").close()
                count += 1
        except OSError as error:
            print(error.errno, count)
    """)
    code, count = result.stdout.split()
    assert int(code) == errno.ENOSPC and int(count) <= LIMITS.max_files


def test_too_many_open_files_are_refused():
    result = attack("""
        handles = []
        try:
            while True:
                handles.append(open("/dev/null"))
        except OSError as error:
            print(error.errno, len(handles))
    """)
    code, count = result.stdout.split()
    assert int(code) == errno.EMFILE and int(count) < LIMITS.open_files


# --- secrets and the caller's processes --------------------------------------------------------


def secret_reading_program() -> str:
    return f"""
        import os
        print(dict(os.environ))
        for pid in os.listdir("/proc"):
            if pid.isdigit():
                try:
                    print(open(f"/proc/{{pid}}/environ", "rb").read())
                except OSError:
                    pass
        for pid in ({os.getpid()}, {os.getppid()}):
            try:
                print(open(f"/proc/{{pid}}/environ", "rb").read())
            except OSError as error:
                print("refused", pid, error.errno)
    """


def test_the_callers_environment_secrets_do_not_reach_the_program(monkeypatch):
    secret = f"fake-secret-{random.randrange(10**9)}"
    monkeypatch.setenv("SKYRL_FAKE_API_KEY", secret)
    result = attack(secret_reading_program())
    assert result.exit_code == 0, result.stderr
    assert secret not in result.stdout and secret not in result.stderr
    assert "SKYRL_FAKE_API_KEY" not in result.stdout


def test_the_callers_proc_entries_are_out_of_reach():
    caller = os.getpid()
    result = attack(f"""
        import os
        pids = sorted(int(p) for p in os.listdir("/proc") if p.isdigit())
        print("pids", pids)
        print("ppid", os.getppid())
        for name in ("cmdline", "mem", "maps", "status"):
            try:
                open(f"/proc/{caller}/{{name}}", "rb").read(16)
                print("READ", name)
            except OSError as error:
                print("refused", name, error.errno)
    """)
    assert "READ" not in result.stdout
    pids = eval(result.stdout.splitlines()[0].removeprefix("pids "))
    assert caller not in pids and max(pids) < 10  # only the sandbox's own pid namespace is visible
    assert result.stdout.splitlines()[1] == "ppid 1"  # its parent is the sandbox's init, not us


def test_signals_cannot_reach_the_caller(sentinel):
    result = attack(f"""
        import os, signal
        for target in (os.getppid(), {os.getpid()}, {sentinel.pid}, -1):
            try:
                os.kill(target, signal.SIGKILL)
                print("sent", target)
            except OSError as error:
                print("refused", target, error.errno)
        try:
            os.killpg({os.getpgid(0)}, signal.SIGKILL)
        except OSError as error:
            print("refused group", error.errno)
    """)
    # We are alive to check; the autouse fixture checks the sentinel.
    assert f"sent {os.getpid()}" not in result.stdout and f"sent {sentinel.pid}" not in result.stdout


def test_privileges_cannot_be_regained():
    result = attack("""
        import os
        try:
            os.setuid(0)
            print("BECAME ROOT")
        except OSError as error:
            print("refused", error.errno)
        caps = [l for l in open("/proc/self/status") if l.startswith(("CapEff", "CapPrm", "CapBnd", "NoNewPrivs"))]
        print("".join(caps))
    """)
    assert "BECAME ROOT" not in result.stdout
    fields = dict(line.split(":\t") for line in result.stdout.splitlines()[1:] if ":\t" in line)
    assert fields["CapEff"] == fields["CapPrm"] == fields["CapBnd"] == "0000000000000000"
    assert fields["NoNewPrivs"] == "1"


def test_a_nested_user_namespace_cannot_unhide_or_remount(world_writable_dir):
    result = attack(f"""
        import ctypes, os
        libc = ctypes.CDLL(None, use_errno=True)
        uid, gid = os.getuid(), os.getgid()
        if libc.unshare(0x10000000 | 0x00020000) != 0:  # CLONE_NEWUSER | CLONE_NEWNS
            print("no nested namespace", ctypes.get_errno())
        else:
            open("/proc/self/setgroups", "w").write("deny")
            open("/proc/self/uid_map", "w").write(f"0 {{uid}} 1")
            open("/proc/self/gid_map", "w").write(f"0 {{gid}} 1")
            print("umount /var/tmp", libc.umount2(b"/var/tmp", 2), ctypes.get_errno())
            print("remount / rw", libc.mount(None, b"/", None, 0x20 | 0x1000, None), ctypes.get_errno())
            print("remount dir rw", libc.mount(None, b"{world_writable_dir}", None, 0x20 | 0x1000, None), ctypes.get_errno())
        try:
            open("{world_writable_dir}/pwned", "w").write("x")
            print("WROTE")
        except OSError as error:
            print("refused", error.errno)
    """)
    assert "WROTE" not in result.stdout, result.stdout
    assert list(world_writable_dir.iterdir()) == []


# --- network -----------------------------------------------------------------------------------


@pytest.fixture
def tcp_listener():
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.bind(("0.0.0.0", 0))
    listener.listen(8)
    listener.setblocking(False)
    yield listener
    listener.close()


def connecting_program(port: int) -> str:
    try:
        host_ip = socket.gethostbyname(socket.gethostname())
    except OSError:
        host_ip = "127.0.0.1"
    return f"""
            import socket
            for address in ("127.0.0.1", "{host_ip}", "8.8.8.8"):
                s = socket.socket()
                s.settimeout(0.5)
                try:
                    s.connect((address, {port} if address != "8.8.8.8" else 53))
                    print("CONNECTED", address)
                except OSError as error:
                    print("refused", address, error.errno)
        """


def test_tcp_connections_to_the_host_fail(tcp_listener):
    result = attack(connecting_program(tcp_listener.getsockname()[1]))
    with pytest.raises(BlockingIOError):
        tcp_listener.accept()  # nobody ever reached us
    assert "CONNECTED" not in result.stdout
    assert result.stdout.count("refused") == 3


def test_udp_and_abstract_unix_sockets_do_not_leave_the_sandbox():
    receiver = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    receiver.bind(("127.0.0.1", 0))
    receiver.setblocking(False)
    abstract_name = f"\0skyrl-attack-{random.randrange(10**9)}"
    unix_listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    unix_listener.bind(abstract_name)
    unix_listener.listen(1)
    unix_listener.setblocking(False)
    try:
        result = attack(f"""
            import socket
            u = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
            try:
                u.sendto(b"leak", ("127.0.0.1", {receiver.getsockname()[1]}))
                print("udp sent")
            except OSError as error:
                print("udp refused", error.errno)
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                s.connect({abstract_name!r})
                print("UNIX CONNECTED")
            except OSError as error:
                print("unix refused", error.errno)
        """)
        with pytest.raises(BlockingIOError):
            receiver.recvfrom(16)
        with pytest.raises(BlockingIOError):
            unix_listener.accept()
    finally:
        receiver.close()
        unix_listener.close()
    assert "UNIX CONNECTED" not in result.stdout


# --- processes, CPU, memory, output ------------------------------------------------------------


def test_a_fork_bomb_is_contained():
    result = attack("""
        import os
        while True:
            try:
                os.fork()
            except OSError:
                pass
    """)
    assert not result.ok


def test_a_thread_bomb_is_contained():
    result = attack("""
        import threading, time
        threads = 0
        try:
            while True:
                threading.Thread(target=time.sleep, args=(30,), daemon=True).start()
                threads += 1
        except RuntimeError:
            print("stopped at", threads)
    """)
    assert result.stdout.startswith("stopped at")
    assert int(result.stdout.split()[-1]) < LIMITS.processes


def test_a_memory_bomb_fails_inside_the_sandbox():
    result = attack("""
        blocks = []
        while True:
            blocks.append(bytearray(16 * 1024 * 1024))
    """)
    assert result.exit_code == 1 and "MemoryError" in result.stderr


def test_an_infinite_loop_is_stopped_by_the_cpu_limit():
    result = attack("while True:\n    pass\n")
    assert result.signal in (signal.SIGXCPU, signal.SIGKILL) and not result.ok


def test_a_sleeping_program_is_killed_at_the_wall_limit():
    result = attack("import time\ntime.sleep(600)\n")
    assert result.timed_out and result.signal == signal.SIGKILL


def test_children_that_detach_do_not_outlive_the_program():
    result = attack("""
        import os, signal, time
        if os.fork() == 0:
            os.setsid()
            if os.fork() == 0:
                signal.signal(signal.SIGHUP, signal.SIG_IGN)
                signal.signal(signal.SIGTERM, signal.SIG_IGN)
                os.close(1); os.close(2)
                time.sleep(600)
            os._exit(0)
        print("parent leaves")
    """)
    assert result.ok and result.stdout == "parent leaves\n"
    # the autouse fixture asserts no sandbox process remains


def test_huge_output_is_capped_and_the_program_killed():
    result = attack("""
        import sys
        while True:
            sys.stdout.write("x" * 65536)
            sys.stderr.write("y" * 65536)
    """)
    assert result.output_truncated and not result.ok
    assert len(result.stdout) <= LIMITS.output_bytes and len(result.stderr) <= LIMITS.output_bytes


def test_sandboxes_running_at_once_cannot_touch_each_other():
    victim_result = {}

    def victim():
        victim_result["r"] = run_python("import time\ntime.sleep(1.0)\nprint('alive')", "", LIMITS)

    thread = threading.Thread(target=victim)
    thread.start()
    time.sleep(0.3)
    attack("""
        import os, signal
        os.kill(-1, signal.SIGKILL)
    """)
    thread.join()
    assert victim_result["r"].ok and victim_result["r"].stdout == "alive\n"


# --- negative controls: the same attacks work without the sandbox -----------------------------


def run_unsandboxed(program: str, cwd: Path) -> str:
    completed = subprocess.run([sys.executable, "-c", textwrap.dedent(program)], capture_output=True, text=True,
                               timeout=30, cwd=cwd)
    return completed.stdout


def test_control_the_attacks_succeed_without_the_sandbox(world_writable_dir, tcp_listener, monkeypatch, tmp_path):
    secret = f"fake-secret-{random.randrange(10**9)}"
    monkeypatch.setenv("SKYRL_FAKE_API_KEY", secret)
    # Only the harmless target: unsandboxed, the others would really change this machine.
    writes = run_unsandboxed(write_outside_program(outside_targets(world_writable_dir)[:1], world_writable_dir), tmp_path)
    assert f"WROTE {world_writable_dir}/pwned" in writes and (world_writable_dir / "pwned").exists()
    assert secret in run_unsandboxed(secret_reading_program(), tmp_path)
    assert "CONNECTED 127.0.0.1" in run_unsandboxed(connecting_program(tcp_listener.getsockname()[1]), tmp_path)
    tcp_listener.accept()[0].close()


# --- plumbing ----------------------------------------------------------------------------------


def test_stdin_is_delivered_and_unread_stdin_is_harmless():
    echoed = run_python("import sys\nprint(len(sys.stdin.read()))", "a" * 300_000, LIMITS)
    assert echoed.ok and echoed.stdout == "300000\n"
    ignored = run_python("print('done')", "b" * 2_000_000, LIMITS)
    assert ignored.ok and ignored.stdout == "done\n"


def test_exit_codes_and_exceptions_are_reported():
    assert run_python("raise SystemExit(3)", "", LIMITS).exit_code == 3
    crashed = run_python("1/0", "", LIMITS)
    assert crashed.exit_code == 1 and "ZeroDivisionError" in crashed.stderr


def test_a_sandbox_that_cannot_be_built_refuses_to_run():
    with pytest.raises(SandboxUnavailable, match="cannot build the code sandbox"):
        run_python("print('ran')", "", LIMITS, python="/nonexistent-dir/bin/python")
