"""Sandbox launcher: run as ``python -I -S launcher.py STAGE_DIR STATUS_FD`` by ``runner.py``.

Standard library only (it runs before any sandbox exists, with ``-S``). The process tree is

    caller (trainer)  ->  launcher (this file, caller's namespaces)
                            -> init (pid 1 of a new pid namespace, root, reaps)
                                 -> program (unprivileged, rlimits, no capabilities)

The launcher leaves the caller's session keyring for a fresh anonymous one, enters new mount,
network, pid, IPC and UTS namespaces (and a user namespace when not root) and turns SysV IPC off in
its IPC namespace. Init mounts a fresh ``/proc`` (only the sandbox's own processes are visible) and
builds a new root filesystem on a tmpfs holding only what ``visible_paths`` and the interpreter
need, read-only (no site-packages: the program gets the standard library only), a few device
nodes and a size-limited ``/tmp`` (the only writable directory and the working directory), then
pivots into it: nothing else of the host is reachable, so answer keys and hidden tests elsewhere
cannot be read. Init forks the program, which joins the sandbox's memory and pids cgroups (when
the caller made them), sets its rlimits, drops every capability, switches to a uid used by nobody
else (root only), installs a seccomp filter (no new user namespaces, no keyring calls) and execs
Python.

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
import sys

CLONE_NEWNS = 0x00020000
CLONE_NEWUTS = 0x04000000
CLONE_NEWIPC = 0x08000000
CLONE_NEWUSER = 0x10000000
CLONE_NEWPID = 0x20000000
CLONE_NEWNET = 0x40000000

MS_NOSUID = 0x2
MS_NODEV = 0x4
MS_NOEXEC = 0x8
MS_BIND = 0x1000
MS_REC = 0x4000
MS_PRIVATE = 0x40000

AT_FDCWD = -100
AT_RECURSIVE = 0x8000
MOUNT_ATTR_RDONLY = 0x1
MOUNT_ATTR_NOSUID = 0x2
MOUNT_ATTR_NODEV = 0x4
SYS_MOUNT_SETATTR = 442  # the same number on every architecture (new-style syscall table)

MNT_DETACH = 0x2

PR_SET_PDEATHSIG = 1
PR_CAPBSET_DROP = 24
PR_SET_NO_NEW_PRIVS = 38
PR_CAP_AMBIENT = 47
PR_CAP_AMBIENT_CLEAR_ALL = 4
PR_SET_SECCOMP = 22
SECCOMP_MODE_FILTER = 2

KEYCTL_JOIN_SESSION_KEYRING = 1
# Per architecture: (AUDIT_ARCH, unshare, clone, clone3, add_key, request_key, keyctl, pivot_root,
# memfd_create).
SYSCALLS = {
    "x86_64": (0xC000003E, 272, 56, 435, 248, 249, 250, 155, 319),
    "aarch64": (0xC00000B7, 97, 220, 435, 217, 218, 219, 41, 279),
}
DEVICES = ("null", "zero", "full", "random", "urandom")
# SysV IPC lives in the sandbox's IPC namespace and outlives a detach: none of it is needed, so
# none is allowed (a memory cgroup would charge it, but not every machine has one).
IPC_SYSCTLS = {"kernel/shmmax": 0, "kernel/shmall": 0, "kernel/shmmni": 0, "kernel/msgmni": 0}

libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long


class SetupError(Exception):
    """The sandbox cannot be built here; the program must not run."""


class ProgramRejected(Exception):
    """The program itself cannot be set up (it does not fit): a failed run, not a broken machine."""


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


# --- keyring, namespaces (launcher) and the new root (init) -----------------------------------------------------


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


def leave_callers_keyring():
    """A fresh anonymous session keyring: the caller's keys are no longer possessed (or reachable)."""
    if libc.syscall(ctypes.c_long(SYSCALLS[os.uname().machine][6]), KEYCTL_JOIN_SESSION_KEYRING, None) < 0:
        errno = ctypes.get_errno()
        if errno != 38:  # ENOSYS: a kernel without keys has no keyring to leave
            raise SetupError(f"keyctl(JOIN_SESSION_KEYRING): {os.strerror(errno)} (errno {errno})")


def turn_off_sysv_ipc():
    for name, value in IPC_SYSCTLS.items():
        with open(f"/proc/sys/{name}", "w") as handle:
            handle.write(str(value))


def bind_directory(source, target):
    os.makedirs(target, mode=0o755, exist_ok=True)
    mount(source, target, None, MS_BIND | MS_REC)


def build_root(config):
    """A new root on a tmpfs at ``config["new_root"]``: visible paths read-only, devices, /proc, /tmp."""
    root = config["new_root"]
    mount(None, "/", None, MS_REC | MS_PRIVATE)
    mount("tmpfs", root, "tmpfs", MS_NOSUID | MS_NODEV, "size=1m,mode=0755")
    for path in config["visible_paths"]:
        target = root + path
        if os.path.islink(path) and os.path.dirname(path) == "/":  # /bin -> usr/bin: the link, as is
            os.symlink(os.readlink(path), target)
        elif os.path.isdir(path):
            bind_directory(os.path.realpath(path), target)
    for path in config["interpreter_paths"]:
        if not os.path.isdir(path):
            raise SetupError(f"the interpreter's directory {path} does not exist")
        bind_directory(path, root + path)
    for path in config["covered_paths"]:  # site-packages under a visible path: an empty directory
        if os.path.isdir(root + path):
            mount("tmpfs", root + path, "tmpfs", MS_NOSUID | MS_NODEV, "size=4k,mode=0755")
    for name in ("proc", "tmp", "dev"):
        os.makedirs(f"{root}/{name}", mode=0o755, exist_ok=True)
    for name in DEVICES:
        open(f"{root}/dev/{name}", "a").close()
    attr = MountAttr(attr_set=MOUNT_ATTR_RDONLY | MOUNT_ATTR_NOSUID | MOUNT_ATTR_NODEV)
    check(libc.syscall(ctypes.c_long(SYS_MOUNT_SETATTR), ctypes.c_int(AT_FDCWD), root.encode(),
                       ctypes.c_uint(AT_RECURSIVE), ctypes.byref(attr), ctypes.c_size_t(ctypes.sizeof(attr))),
          "mount_setattr(new root, read-only, recursive)")
    # Mounted after the read-only pass: writable where they must be.
    for name in DEVICES:
        mount(f"/dev/{name}", f"{root}/dev/{name}", None, MS_BIND)
    mount("proc", f"{root}/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
    uid, gid = config["uid"], config["gid"]
    mount("tmpfs", f"{root}/tmp", "tmpfs", MS_NOSUID | MS_NODEV,
          f"size={config['tmpfs_bytes']},nr_inodes={config['max_files']},mode=0700,uid={uid},gid={gid}")
    try:
        with open(f"{root}/tmp/main.py", "w", encoding="utf-8") as handle:
            handle.write(config["program"])
    except OSError as error:  # the model's program does not fit: its failure, not the machine's
        raise ProgramRejected(f"the program does not fit in the sandbox's /tmp ({error.strerror})") from None
    os.chown(f"{root}/tmp/main.py", uid, gid)
    os.chdir(root)
    check(libc.syscall(ctypes.c_long(SYSCALLS[os.uname().machine][7]), b".", b"."), "pivot_root")
    check(libc.umount2(b".", MNT_DETACH), "umount the old root")
    os.chdir("/")
    if not os.access(config["python"], os.X_OK):
        raise SetupError(f"the interpreter {config['python']} is not reachable inside the sandbox")


# --- the program (a child of init) -----------------------------------------------------------------------


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


def join_cgroups(procs_fds):
    """Move this process (and so every child it makes) into the sandbox's cgroups."""
    for fd in procs_fds:
        os.write(fd, b"0")  # "0": the writing process itself, whatever pid namespace it is in
        os.close(fd)


def seccomp_filter():
    """BPF: deny new user namespaces (clone3 cannot be inspected: ENOSYS, libc falls back to clone),
    the keyring calls and memfd_create (RAM-backed files outside /tmp's quota and every address-space
    limit); every other ABI of this machine (x32, i386) is killed."""
    arch, unshare, clone, clone3, add_key, request_key, keyctl, _, memfd_create = SYSCALLS[os.uname().machine]
    ld, jeq, jset, jge, ret = 0x20, 0x15, 0x45, 0x35, 0x06
    allow, kill = 0x7FFF0000, 0x80000000
    eperm, enosys = 0x00050000 | 1, 0x00050000 | 38
    program = [
        (ld, 0, 0, 4), (jeq, 1, 0, arch), (ret, 0, 0, kill),       # seccomp_data.arch
        (ld, 0, 0, 0),                                               # seccomp_data.nr
        (jge, 0, 1, 0x40000000), (ret, 0, 0, kill),                  # the x32 ABI
        (jeq, 0, 1, clone3), (ret, 0, 0, enosys),
        (jeq, 3, 0, add_key), (jeq, 2, 0, request_key), (jeq, 1, 0, keyctl), (jeq, 0, 1, memfd_create),
        (ret, 0, 0, eperm),
        (jeq, 1, 0, unshare), (jeq, 0, 3, clone),
        (ld, 0, 0, 16),                                              # args[0], low 32 bits: the flags
        (jset, 0, 1, CLONE_NEWUSER), (ret, 0, 0, eperm),
        (ret, 0, 0, allow),
    ]
    return program


class SockFilter(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint16), ("jt", ctypes.c_uint8), ("jf", ctypes.c_uint8), ("k", ctypes.c_uint32)]


class SockFprog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.POINTER(SockFilter))]


def install_seccomp():
    instructions = seccomp_filter()
    table = (SockFilter * len(instructions))(*(SockFilter(*i) for i in instructions))
    program = SockFprog(len(instructions), table)
    check(libc.prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, ctypes.byref(program), 0, 0), "prctl(PR_SET_SECCOMP)")


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


def run_program(config, privileged, status_fd, procs_fds):
    try:  # a step that fails here means the sandbox is incomplete: refuse, as for the launcher's steps
        os.chdir("/tmp")
        join_cgroups(procs_fds)
        set_limits(config)
        drop_privileges(config, privileged)
        install_seccomp()  # after no_new_privs (required), last before exec
    except (SetupError, OSError, ValueError) as error:
        write_status(status_fd, error=f"preparing the program: {error}")
        os._exit(127)
    os.close(status_fd)
    os.execve(config["python"], [config["python"], "-I", "-B", "main.py"], config["env"])


def run_init(config, privileged, status_fd, alive_fd, procs_fds):
    """Pid 1 of the sandbox: build the root (with /proc), start the program, reap until it ends, report."""
    die_with_parent(alive_fd)
    os.close(alive_fd)
    try:
        build_root(config)
    except ProgramRejected as error:
        write_status(status_fd, rejected=str(error))
        os._exit(0)
    except (SetupError, OSError) as error:
        write_status(status_fd, error=str(error))
        os._exit(0)
    program = os.fork()
    if program == 0:
        try:
            run_program(config, privileged, status_fd, procs_fds)
        except BaseException as error:  # exec failed: say so on the program's stderr
            os.write(2, f"sandbox: cannot start the program: {error}\n".encode())
        os._exit(127)
    for fd in procs_fds:  # only the program joins the cgroups; init keeps no handle on them
        os.close(fd)
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
        procs_fds = [os.open(path, os.O_WRONLY) for path in config["cgroup_procs"]]
        leave_callers_keyring()
        enter_namespaces(privileged)
        turn_off_sysv_ipc()
    except (SetupError, OSError) as error:
        write_status(status_fd, error=str(error))
        os._exit(0)
    init = os.fork()
    if init == 0:
        os.close(alive_write)
        run_init(config, privileged, status_fd, alive_read, procs_fds)
    for fd in procs_fds:
        os.close(fd)
    os.close(alive_read)
    _, status = os.waitpid(init, 0)
    if os.WIFSIGNALED(status) or os.WEXITSTATUS(status) != 0:
        write_status(status_fd, error=f"sandbox init failed (wait status {status})")
    os._exit(0)


if __name__ == "__main__":
    main()
