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

import attrs
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


# --- the sandbox as a whole: memory, the keyring, what is visible (issue 17) --------------------

BUDGET = 128 * MIB  # total_memory_bytes of the tests below: the whole sandbox's RAM
WHOLE = attrs.evolve(LIMITS, wall_seconds=5.0, cpu_seconds=3, total_memory_bytes=BUDGET)


def test_a_nested_namespace_tmpfs_cannot_fill_ram():
    """unshare(user + mount), mount a tmpfs, write twice the budget into it."""
    result = attack(f"""
        import ctypes, os
        libc = ctypes.CDLL(None, use_errno=True)
        uid, gid = os.getuid(), os.getgid()
        if libc.unshare(0x10000000 | 0x00020000) != 0:
            print("unshare refused", ctypes.get_errno())
        else:
            open("/proc/self/setgroups", "w").write("deny")
            open("/proc/self/uid_map", "w").write(f"0 {{uid}} 1")
            open("/proc/self/gid_map", "w").write(f"0 {{gid}} 1")
            os.makedirs("/tmp/ram", exist_ok=True)
            print("mount", libc.mount(b"tmpfs", b"/tmp/ram", b"tmpfs", 0, b"size=1g"), flush=True)
        written = 0
        try:
            with open("/tmp/ram/fill" if os.path.ismount("/tmp/ram") else "/tmp/fill", "wb") as handle:
                while written < {2 * BUDGET}:
                    handle.write(b"x" * {16 * MIB})
                    written += {16 * MIB}
                    handle.flush()
        except OSError as error:
            print("stopped", error.errno)
        print("written", written, flush=True)
    """, limits=WHOLE)
    assert "unshare refused 1" in result.stdout, result.stdout  # EPERM: no nested user namespace
    written = [int(line.split()[1]) for line in result.stdout.splitlines() if line.startswith("written")]
    assert written and written[0] <= WHOLE.disk_bytes


def hold_in_children(children: int, each: int) -> str:
    """Each child fills ``each`` bytes and keeps them; prints how much was held at once."""
    return f"""
        import os, time
        ready_read, ready_write = os.pipe()
        pids = []
        for _ in range({children}):
            pid = os.fork()
            if pid == 0:
                try:
                    block = b"\\x01" * {each}
                    os.write(ready_write, b"+")
                except MemoryError:
                    os._exit(3)
                time.sleep(30)
                os._exit(0)
            pids.append(pid)
        os.set_blocking(ready_read, False)
        ready, deadline = b"", time.monotonic() + 3
        while len(ready) < {children} and time.monotonic() < deadline:
            try:
                ready += os.read(ready_read, {children})
            except BlockingIOError:
                time.sleep(0.05)
        alive = sum(os.waitpid(pid, os.WNOHANG) == (0, 0) for pid in pids)
        print("held", min(alive, len(ready)) * {each}, len(ready), alive)
    """


@pytest.mark.parametrize("bound", ["cgroup", "address_space"])
def test_many_processes_cannot_hold_more_than_the_whole_budget(bound, monkeypatch):
    """Children each within their own address-space limit, together twice over the sandbox's budget."""
    from skyrl_envs.sandbox import runner

    if bound == "cgroup":
        limits, children = WHOLE, 4  # 4 x 96 MiB against 128 MiB
    else:  # as on a machine without a memory cgroup: the budget is split over the processes
        monkeypatch.setattr(runner, "make_cgroups", lambda *args: None)
        limits, children = attrs.evolve(WHOLE, total_memory_bytes=512 * MIB), 6  # 6 x 96 MiB against 512 MiB
    result = attack(hold_in_children(children, 96 * MIB), limits=limits)
    assert result.memory_bound == bound
    assert result.stdout.startswith("held"), (result.stdout, result.stderr[-300:])
    assert int(result.stdout.split()[1]) <= limits.total_memory_bytes, result.stdout


def test_without_a_cgroup_a_budget_too_small_to_split_is_refused(monkeypatch):
    from skyrl_envs.sandbox import runner

    monkeypatch.setattr(runner, "make_cgroups", lambda *args: None)
    with pytest.raises(SandboxUnavailable, match="total_memory_bytes / processes"):
        run_python("print(1)", "", attrs.evolve(WHOLE, total_memory_bytes=64 * MIB))


def test_sysv_shared_memory_cannot_grow_past_the_budget():
    """Segments outlive their detach: 2x the budget in 32 MiB segments, each touched then detached."""
    result = attack(f"""
        import ctypes
        libc = ctypes.CDLL(None, use_errno=True)
        libc.shmat.restype = ctypes.c_void_p
        held = 0
        for number in range({2 * BUDGET // (32 * MIB)}):
            segment = libc.shmget(0, {32 * MIB}, 0o1600)  # IPC_PRIVATE, IPC_CREAT | 0600
            if segment < 0:
                print("shmget refused", ctypes.get_errno())
                break
            address = libc.shmat(segment, None, 0)
            if address in (None, ctypes.c_void_p(-1).value):
                print("shmat refused", ctypes.get_errno())
                break
            ctypes.memset(address, 1, {32 * MIB})
            libc.shmdt(ctypes.c_void_p(address))
            held += {32 * MIB}
            print("held", held, flush=True)
    """, limits=WHOLE)
    held = [int(line.split()[1]) for line in result.stdout.splitlines() if line.startswith("held")]
    assert max(held, default=0) <= BUDGET, result.stdout


@pytest.mark.parametrize("bound", ["cgroup", "address_space"])
def test_memfd_files_cannot_grow_past_the_budget(bound, monkeypatch):
    """RAM-backed anonymous files: outside /tmp's quota and outside RLIMIT_AS (nothing is mapped)."""
    from skyrl_envs.sandbox import runner

    limits = attrs.evolve(WHOLE, total_memory_bytes=512 * MIB) if bound == "address_space" else WHOLE
    if bound == "address_space":
        monkeypatch.setattr(runner, "make_cgroups", lambda *args: None)
    result = attack(f"""
        import os
        held, files = 0, []
        try:
            while held < {2 * limits.total_memory_bytes}:
                fd = os.memfd_create("fill")
                files.append(fd)
                for _ in range(4):  # 4 x 512 KiB per file: under file_size_bytes (2 MiB)
                    os.write(fd, b"x" * {512 * 1024})
                    held += {512 * 1024}
        except OSError as error:
            print("stopped", error.errno)
        print("held", held, flush=True)
    """, limits=attrs.evolve(limits, open_files=1024))
    assert result.memory_bound == bound
    held = [int(line.split()[1]) for line in result.stdout.splitlines() if line.startswith("held")]
    assert max(held, default=0) <= limits.total_memory_bytes, result.stdout


KEYCTL = {"x86_64": (248, 249, 250), "aarch64": (217, 218, 219)}[os.uname().machine]  # add_key, request_key, keyctl


def _keyring_call(*args):
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    libc.syscall.restype = ctypes.c_long
    return libc.syscall(*args)


def test_the_callers_session_keyring_is_out_of_reach():
    add_key, _, keyctl = KEYCTL
    # A session keyring of our own (this thread's), holding a secret.
    assert _keyring_call(keyctl, 1, b"skyrl-test-session") > 0  # KEYCTL_JOIN_SESSION_KEYRING
    secret = f"keyring-secret-{random.randrange(10**9)}".encode()
    key = _keyring_call(add_key, b"user", b"skyrl-secret", secret, len(secret), -3)  # KEY_SPEC_SESSION_KEYRING
    assert key > 0
    result = attack(f"""
        import ctypes
        libc = ctypes.CDLL(None, use_errno=True)
        libc.syscall.restype = ctypes.c_long
        add_key, request_key, keyctl = {KEYCTL}
        buffer = ctypes.create_string_buffer(256)
        for target in ({key}, libc.syscall(keyctl, 10, -3, b"user", b"skyrl-secret", 0)):  # KEYCTL_SEARCH
            length = libc.syscall(keyctl, 11, target, buffer, 256)  # KEYCTL_READ
            print("read", target, length, ctypes.get_errno(), buffer.raw[:max(length, 0)])
        found = libc.syscall(request_key, b"user", b"skyrl-secret", None, 0)
        print("request_key", found, ctypes.get_errno())
        planted = libc.syscall(add_key, b"user", b"planted", b"x", 1, -3)
        print("add_key", planted, ctypes.get_errno())
        print("keys", open("/proc/keys").read() if __import__("os").path.exists("/proc/keys") else "")
    """)
    assert secret.decode() not in result.stdout, result.stdout
    assert "skyrl-secret" not in result.stdout.split("keys", 1)[-1]
    # Nothing the program did outlives it in our keyring.
    assert _keyring_call(keyctl, 10, -3, b"user", b"planted", 0) == -1


def test_only_the_interpreter_and_system_libraries_are_visible(world_writable_dir):
    """Hidden tests and answer keys in world-readable files elsewhere cannot be read."""
    answers = world_writable_dir / "hidden_tests.jsonl"
    answers.write_text('{"input": "1 2", "output": "3"}\n')
    answers.chmod(0o644)
    repo_answer_key = Path(__file__).resolve().parents[1] / "src/skyrl_envs/data/multi_tool/questions.jsonl"
    site_packages = [p for p in sys.path if p.endswith("-packages") and os.path.isdir(p)]
    base_site = Path(os.path.realpath(sys.base_prefix)) / "lib" / f"python{sys.version_info[0]}.{sys.version_info[1]}" / "site-packages"
    result = attack(f"""
        import os
        for path in {[str(answers), str(repo_answer_key), *site_packages, str(base_site), "/etc/passwd", "/work", "/opt"]!r}:
            try:
                if os.path.isdir(path):
                    entries = os.listdir(path)
                    print("LISTED" if entries else "empty", path, entries[:3])
                else:
                    print("READ", path, open(path).read()[:40])
            except OSError as error:
                print("refused", path, error.errno)
        print("root", sorted(os.listdir("/")))
    """)
    assert result.exit_code == 0, result.stderr
    assert "READ" not in result.stdout and "LISTED" not in result.stdout, result.stdout
    root = eval(result.stdout.splitlines()[-1].removeprefix("root "))
    assert set(root) <= {"usr", "bin", "lib", "lib64", "lib32", "libx32", "sbin", "dev", "proc", "tmp", "root"}, root


def test_site_packages_are_shown_only_when_asked():
    base_site = Path(os.path.realpath(sys.base_prefix)) / "lib" / f"python{sys.version_info[0]}.{sys.version_info[1]}" / "site-packages"
    program = f"import os\nprint(len(os.listdir({str(base_site)!r})))"
    assert run_python(program, "", LIMITS).stdout == "0\n"
    if base_site.is_dir() and any(base_site.iterdir()):
        assert int(run_python(program, "", attrs.evolve(LIMITS, site_packages=True)).stdout) > 0
    with pytest.raises(ValueError, match="site_packages must be true or false"):
        SandboxLimits(site_packages="yes")


# --- model text never stops a run; stale sandboxes are cleaned up -------------------------------


@pytest.mark.parametrize("program, reason", [
    ("print('\ud800')", "not valid UTF-8"),                 # a lone surrogate
    ("x = 1\n" + "#" * (5 * MIB), "larger than"),             # over disk_bytes (4 MiB)
    ("print(1)\x00", None),                                   # a NUL byte: Python's own SyntaxError
])
def test_a_program_the_sandbox_cannot_hold_is_a_failed_run_not_an_error(program, reason):
    result = run_python(program, "", LIMITS)
    assert not result.ok
    if reason is None:
        assert result.exit_code == 1 and "SyntaxError" in result.stderr
    else:
        assert result.rejected and reason in result.rejected and result.exit_code is None


def _dead_pid() -> int:
    child = subprocess.Popen(["true"])
    child.wait()
    return child.pid


def test_stale_sandbox_directories_of_dead_callers_are_removed():
    from skyrl_envs.sandbox import stale
    from skyrl_envs.sandbox.cgroup import cgroup_parents

    killed = subprocess.Popen(
        [sys.executable, "-c", "from skyrl_envs.sandbox import run_python, SandboxLimits\n"
         "run_python('import time; time.sleep(60)', '', SandboxLimits(wall_seconds=60))"])
    deadline = time.monotonic() + 10
    while not stale.stage_dirs_of(killed.pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    leftovers = stale.stage_dirs_of(killed.pid)
    assert leftovers, "the sandbox of the caller never started"
    killed.kill()
    killed.wait()
    assert all(path.exists() for path in leftovers)  # a SIGKILLed caller cannot clean up after itself
    live = stale.new_stage_dir()  # one of ours, alive: must survive
    try:
        removed = stale.remove_stale_sandboxes()
        assert set(leftovers) <= set(removed) and not any(path.exists() for path in leftovers)
        for parent in set((cgroup_parents() or {}).values()):  # its cgroups too
            assert not [p for p in parent.iterdir() if p.name.startswith(leftovers[0].name.rsplit("-", 1)[0])]
        assert live.exists() and live not in removed
    finally:
        live.rmdir()
