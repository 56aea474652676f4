"""Sandbox launcher: run as ``python -I -S launcher.py STAGE_DIR STATUS_FD`` by ``runner.py``.

Standard library only (it runs before any sandbox exists, with ``-S``). The process tree is

    caller (trainer)  ->  launcher (this file, caller's namespaces)
                            -> init (pid 1 of a new pid namespace, root, reaps)
                                 -> program (unprivileged, rlimits, no capabilities)

The launcher enters new mount, network, pid, IPC and UTS namespaces (and a user namespace when
not root), makes the whole filesystem read-only, hides ``/tmp``, ``/home``, ``/root`` and friends
behind empty read-only tmpfs mounts, gives the program a fresh size-limited tmpfs at ``/tmp`` as its
only writable directory and working directory, and forks init. Init mounts a fresh ``/proc`` (only
the sandbox's own processes are visible) and forks the program, which sets its rlimits, drops every
capability, switches to a uid used by nobody else (root only) and execs Python.

When init exits, the kernel kills every process left in the pid namespace, so no child outlives
the program; init dies with the launcher (parent-death signal), so the caller kills everything by
killing the launcher's process group. Status goes to ``STATUS_FD`` as JSON lines:
``{"error": ...}`` (setup failed: the sandbox refuses to run), ``{"exit_code": n}`` or
``{"signal": n}`` (how the program ended).
"""

import ctypes
import json
import os
import resource
import select
import signal
import stat
import sys

CLONE_NEWNS = 0x00020000
CLONE_NEWUTS = 0x04000000
CLONE_NEWIPC = 0x08000000
CLONE_NEWUSER = 0x10000000
CLONE_NEWPID = 0x20000000
CLONE_NEWNET = 0x40000000

MS_RDONLY = 0x1
MS_NOSUID = 0x2
MS_NODEV = 0x4
MS_NOEXEC = 0x8
MS_REMOUNT = 0x20
MS_BIND = 0x1000
MS_REC = 0x4000
MS_PRIVATE = 0x40000

AT_FDCWD = -100
AT_RECURSIVE = 0x8000
MOUNT_ATTR_RDONLY = 0x1
SYS_MOUNT_SETATTR = 442  # the same number on every architecture (new-style syscall table)

PR_SET_PDEATHSIG = 1
PR_CAPBSET_DROP = 24
PR_SET_NO_NEW_PRIVS = 38
PR_CAP_AMBIENT = 47
PR_CAP_AMBIENT_CLEAR_ALL = 4

libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long


class SetupError(Exception):
    """The sandbox cannot be built here; the program must not run."""


class MountAttr(ctypes.Structure):
    _fields_ = [("attr_set", ctypes.c_uint64), ("attr_clr", ctypes.c_uint64),
                ("propagation", ctypes.c_uint64), ("userns_fd", ctypes.c_uint64)]


def check(result, what):
    if result != 0:
        errno = ctypes.get_errno()
        raise SetupError(f"{what}: {os.strerror(errno)} (errno {errno})")


def mount(source, target, fstype, flags, data=None):
    check(libc.mount(source and source.encode(), target.encode(), fstype and fstype.encode(),
                     ctypes.c_ulong(flags), data and data.encode()), f"mount {fstype or source} on {target}")


def write_status(fd, **fields):
    os.write(fd, (json.dumps(fields) + "\n").encode())


# --- namespaces and filesystem (launcher) -----------------------------------------------------


def enter_namespaces(privileged):
    flags = CLONE_NEWNS | CLONE_NEWNET | CLONE_NEWPID | CLONE_NEWIPC | CLONE_NEWUTS
    if privileged:
        check(libc.unshare(flags), "unshare(mount, net, pid, ipc, uts namespaces)")
        return
    uid, gid = os.getuid(), os.getgid()
    check(libc.unshare(flags | CLONE_NEWUSER), "unshare(user namespace) as an unprivileged user")
    for name, text in (("uid_map", f"0 {uid} 1"), ("setgroups", "deny"), ("gid_map", f"0 {gid} 1")):
        with open(f"/proc/self/{name}", "w") as handle:
            handle.write(text)


def blocking_ancestor(path, hidden, privileged):
    """The highest directory above ``path`` that hides it from the program, or None."""
    current = "/"
    for part in path.strip("/").split("/"):
        current = os.path.join(current, part)
        if current == path:
            return None
        if current in hidden:
            return current
        if privileged and not os.stat(current).st_mode & stat.S_IXOTH:
            return current
    return None


def build_filesystem(config, privileged):
    hidden = [p for p in config["hide_paths"] if os.path.isdir(p) and not os.path.islink(p)]
    exposed = []  # (path, O_PATH fd) opened before anything is covered
    covers = set(hidden)
    for path in config["expose_paths"]:
        blocker = blocking_ancestor(path, set(hidden), privileged)
        if blocker is not None:
            exposed.append((path, os.open(path, os.O_PATH | os.O_DIRECTORY)))
            covers.add(blocker)

    mount(None, "/", None, MS_REC | MS_PRIVATE)
    attr = MountAttr(attr_set=MOUNT_ATTR_RDONLY)
    check(libc.syscall(ctypes.c_long(SYS_MOUNT_SETATTR), ctypes.c_int(AT_FDCWD), b"/",
                       ctypes.c_uint(AT_RECURSIVE), ctypes.byref(attr), ctypes.c_size_t(ctypes.sizeof(attr))),
          "mount_setattr(/, read-only, recursive)")
    for path in sorted(covers):
        mount("tmpfs", path, "tmpfs", MS_NOSUID | MS_NODEV, "size=1m,mode=0755")
    for path, fd in exposed:
        os.makedirs(path, mode=0o755, exist_ok=True)
        mount(f"/proc/self/fd/{fd}", path, None, MS_BIND | MS_REC)
        mount(None, path, None, MS_BIND | MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV)
        os.close(fd)
    for path in sorted(covers, key=len, reverse=True):
        mount(None, path, None, MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV)

    uid, gid = config["uid"], config["gid"]
    mount("tmpfs", "/tmp", "tmpfs", MS_NOSUID | MS_NODEV,
          f"size={config['tmpfs_bytes']},nr_inodes={config['max_files']},mode=0700,uid={uid},gid={gid}")
    with open("/tmp/main.py", "w", encoding="utf-8") as handle:
        handle.write(config["program"])
    os.chown("/tmp/main.py", uid, gid)


# --- init and program -----------------------------------------------------------------------


def die_with_parent(alive_fd):
    """SIGKILL this process when its parent dies; exit now if the parent is already gone."""
    check(libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0), "prctl(PR_SET_PDEATHSIG)")
    readable, _, _ = select.select([alive_fd], [], [], 0)
    if readable:  # the parent's end was closed: it died before we could arm the signal
        os._exit(1)


def set_limits(config):
    limits = config["limits"]
    for name, value in (("RLIMIT_AS", limits["memory_bytes"]), ("RLIMIT_FSIZE", limits["file_size_bytes"]),
                        ("RLIMIT_NOFILE", limits["open_files"]), ("RLIMIT_CORE", 0)):
        resource.setrlimit(getattr(resource, name), (value, value))
    resource.setrlimit(resource.RLIMIT_CPU, (limits["cpu_seconds"], limits["cpu_seconds"] + 1))
    nproc = limits["processes"] + config["nproc_baseline"]
    resource.setrlimit(resource.RLIMIT_NPROC, (nproc, nproc))


def drop_privileges(config, privileged):
    with open("/proc/sys/kernel/cap_last_cap") as handle:
        last_cap = int(handle.read())
    for cap in range(last_cap + 1):  # an empty bounding set: exec can never grant a capability
        check(libc.prctl(PR_CAPBSET_DROP, cap, 0, 0, 0), f"prctl(PR_CAPBSET_DROP, {cap})")
    check(libc.prctl(PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL, 0, 0, 0), "prctl(PR_CAP_AMBIENT_CLEAR_ALL)")
    if privileged:
        os.setgroups([])
        os.setresgid(config["gid"], config["gid"], config["gid"])
        os.setresuid(config["uid"], config["uid"], config["uid"])
    check(libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "prctl(PR_SET_NO_NEW_PRIVS)")


def run_program(config, privileged, status_fd):
    os.close(status_fd)
    os.chdir("/tmp")
    set_limits(config)
    drop_privileges(config, privileged)
    os.execve(config["python"], [config["python"], "-I", "-B", "main.py"], config["env"])


def run_init(config, privileged, status_fd, alive_fd):
    """Pid 1 of the sandbox: mount /proc, start the program, reap until it ends, report."""
    die_with_parent(alive_fd)
    os.close(alive_fd)
    try:
        mount("proc", "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
    except SetupError as error:
        write_status(status_fd, error=str(error))
        os._exit(0)
    program = os.fork()
    if program == 0:
        try:
            run_program(config, privileged, status_fd)
        except BaseException as error:  # exec failed: say so on the program's stderr
            os.write(2, f"sandbox: cannot start the program: {error}\n".encode())
        os._exit(127)
    while True:
        pid, status = os.waitpid(-1, 0)
        if pid == program:
            break
    if os.WIFSIGNALED(status):
        write_status(status_fd, signal=os.WTERMSIG(status))
    else:
        write_status(status_fd, exit_code=os.WEXITSTATUS(status))
    os._exit(0)  # the kernel now kills whatever the program left behind


def main():
    stage_dir, status_fd = sys.argv[1], int(sys.argv[2])
    with open(os.path.join(stage_dir, "config.json"), encoding="utf-8") as handle:
        config = json.load(handle)
    privileged = os.geteuid() == 0
    # Root runs the program as a uid no other process uses (unique while this launcher lives), so
    # RLIMIT_NPROC counts only this sandbox and no other sandbox can signal or read its files.
    config["uid"] = config["gid"] = config["uid_base"] + os.getpid() if privileged else 0
    try:
        alive_read, alive_write = os.pipe()
        check(libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0), "prctl(PR_SET_PDEATHSIG)")
        if os.getppid() != config["caller_pid"]:
            raise SetupError("the caller exited before the sandbox started")
        enter_namespaces(privileged)
        build_filesystem(config, privileged)
    except (SetupError, OSError) as error:
        write_status(status_fd, error=str(error))
        os._exit(0)
    init = os.fork()
    if init == 0:
        os.close(alive_write)
        run_init(config, privileged, status_fd, alive_read)
    os.close(alive_read)
    _, status = os.waitpid(init, 0)
    if os.WIFSIGNALED(status) or os.WEXITSTATUS(status) != 0:
        write_status(status_fd, error=f"sandbox init failed (wait status {status})")
    os._exit(0)


if __name__ == "__main__":
    main()
