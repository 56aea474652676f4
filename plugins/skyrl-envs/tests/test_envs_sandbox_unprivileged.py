"""The sandbox's other path: a caller that is not root (the user-namespace path of launcher.py).

Run when the suite runs as root: a helper enters a private mount namespace, makes this
interpreter reachable by an unprivileged uid (it may live under a 0700 directory such as
/root), becomes ``nobody`` and attacks from there. The decisive difference from the root path:
the program runs as the caller's own uid, so only the namespaces keep it from the caller's
processes (a sentinel owned by that same uid must survive) and from writing the caller's files.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

import pytest

NOBODY = 65534
HELPER = textwrap.dedent('''
    import json, os, stat, subprocess, sys, tempfile
    # 1. As root in a private mount namespace: expose the interpreter to other users.
    subprocess.run(["mount", "--make-rprivate", "/"], check=True)
    prefix = os.path.realpath(sys.base_prefix)
    parts, blocker = prefix.strip("/").split("/"), None
    for i in range(1, len(parts)):
        path = "/" + "/".join(parts[:i])
        if not os.stat(path).st_mode & stat.S_IXOTH:
            blocker = path
            break
    if blocker:
        holder = tempfile.mkdtemp()
        subprocess.run(["mount", "--bind", prefix, holder], check=True)
        subprocess.run(["mount", "-t", "tmpfs", "-o", "mode=755", "tmpfs", blocker], check=True)
        os.makedirs(prefix, exist_ok=True)
        subprocess.run(["mount", "--move", holder, prefix], check=True)
        os.rmdir(holder)
    # 2. Become nobody, with a sentinel process of that same uid.
    os.setgroups([]); os.setresgid(65534, 65534, 65534); os.setresuid(65534, 65534, 65534)
    os.environ["HOME"] = "/tmp"
    sentinel = subprocess.Popen(["sleep", "300"])
    writable = sys.argv[1]
    from skyrl_envs.sandbox import SandboxLimits, run_python
    limits = SandboxLimits(wall_seconds=2.0, cpu_seconds=1, processes=8)
    programs = {
        "write": f"open('{writable}/pwned', 'w').write('x')",
        "kill": f"import os, signal\\nfor p in (-1, {os.getpid()}, {sentinel.pid}):\\n    try: os.kill(p, signal.SIGKILL)\\n    except OSError: pass",
        "connect": "import socket\\nsocket.create_connection(('127.0.0.1', 22), timeout=1)",
        "remount": "import ctypes\\nlibc = ctypes.CDLL(None, use_errno=True)\\nassert libc.mount(None, b'/', None, 0x20 | 0x1000, None) == 0",
        "fork_bomb": "import os\\nwhile True:\\n    try: os.fork()\\n    except OSError: pass",
        "nested_userns": "import ctypes\\nlibc = ctypes.CDLL(None, use_errno=True)\\nprint(libc.unshare(0x10000000), ctypes.get_errno())",
        "sysv_shm": "import ctypes\\nlibc = ctypes.CDLL(None, use_errno=True)\\nprint(libc.shmget(0, 1 << 20, 0o1600), ctypes.get_errno())",
        "keyctl": "import ctypes, os\\nlibc = ctypes.CDLL(None, use_errno=True)\\nnr = {'x86_64': 250, 'aarch64': 219}[os.uname().machine]\\nprint(libc.syscall(nr, 0, -3, 0), ctypes.get_errno())",
        "identity": "import os\\nprint(os.getuid(), os.getppid(), [l.split()[1] for l in open('/proc/self/status') if l.startswith('CapEff')][0])",
    }
    results = {name: run_python(program, "", limits) for name, program in programs.items()}
    report = {name: [r.exit_code, r.timed_out, r.stdout, r.stderr[-300:]] for name, r in results.items()}
    report["memory_bound"] = results["identity"].memory_bound
    report["sentinel_alive"] = sentinel.poll() is None
    report["wrote"] = os.path.exists(f"{writable}/pwned")
    sentinel.kill()
    print(json.dumps(report))
''')


@pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("unshare"), reason="needs root to become another user")
def test_attacks_from_an_unprivileged_caller_fail(tmp_path):
    writable = Path(tempfile.mkdtemp(prefix="skyrl-unpriv-", dir="/var/cache" if os.access("/var/cache", os.W_OK) else None))
    writable.chmod(0o777)
    (tmp_path / "helper.py").write_text(HELPER)
    (tmp_path).chmod(0o755)
    try:
        completed = subprocess.run(["unshare", "-m", sys.executable, str(tmp_path / "helper.py"), str(writable)],
                                   capture_output=True, text=True, timeout=120, cwd="/")
        assert completed.returncode == 0, completed.stderr[-2000:]
        report = json.loads(completed.stdout.splitlines()[-1])
        assert not (writable / "pwned").exists()
    finally:
        shutil.rmtree(writable, ignore_errors=True)
    assert report["sentinel_alive"] and not report["wrote"]
    assert report["write"][0] == 1 and "No such file or directory" in report["write"][3]  # not even visible
    assert report["kill"][0] == 0  # every kill failed quietly: only the sandbox's namespace is reachable
    assert report["connect"][0] == 1 and "Network is unreachable" in report["connect"][3]
    assert report["remount"][0] == 1 and "AssertionError" in report["remount"][3]
    assert report["fork_bomb"][0] is None  # killed at the wall limit
    assert report["identity"][2] == "0 1 0000000000000000\n"  # root of its own namespace, no capabilities
    assert report["nested_userns"][2] == "-1 1\n"  # EPERM: the seccomp filter
    assert report["sysv_shm"][2] == "-1 22\n" or report["sysv_shm"][2] == "-1 28\n"  # SysV IPC is off
    assert report["keyctl"][2] == "-1 1\n"
    assert report["memory_bound"] in ("cgroup", "address_space")
