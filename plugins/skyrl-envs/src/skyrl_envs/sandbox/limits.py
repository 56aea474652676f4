"""Resource limits of one sandboxed run (a light module: the code env's options embed it)."""

from __future__ import annotations

import os

import attrs

MIB = 1024 * 1024


def _positive(instance: object, attribute: attrs.Attribute, value: float) -> None:
    if not isinstance(value, (int, float)) or isinstance(value, bool) or value <= 0:
        raise ValueError(f"sandbox limit {attribute.name} must be a positive number, got {value!r}")


def _boolean(attribute: attrs.Attribute, value: object) -> None:
    if not isinstance(value, bool):
        raise ValueError(f"sandbox {attribute.name} must be true or false, got {value!r}")


_RESERVED = ("", "/tmp", "/proc", "/dev")  # the sandbox's own mounts


def _absolute_paths(instance: object, attribute: attrs.Attribute, value: tuple[str, ...]) -> None:
    for path in value:
        if (not isinstance(path, str) or not path.startswith("/") or path.rstrip("/") in _RESERVED
                or os.path.normpath(path) != path):
            raise ValueError(f"sandbox {attribute.name} must be normalised absolute directories other than "
                             f"/, /tmp, /proc and /dev, got {path!r}")


@attrs.frozen(kw_only=True)
class SandboxLimits:
    """What one program may use. Every limit applies to each run separately."""

    # Inside, the program sees only visible_paths and its interpreter (read-only, without any
    # site-packages), /dev/{null,zero,full,random,urandom}, its own /proc and a private /tmp.

    wall_seconds: float = attrs.field(default=10.0, validator=_positive,
                                      metadata={"help": "wall-clock limit; the whole sandbox is killed after it"})
    cpu_seconds: int = attrs.field(default=5, validator=_positive,
                                   metadata={"help": "CPU seconds per process (RLIMIT_CPU)"})
    memory_bytes: int = attrs.field(default=512 * MIB, validator=_positive,
                                    metadata={"help": "address space per process (RLIMIT_AS)"})
    total_memory_bytes: int = attrs.field(
        default=1024 * MIB, validator=_positive,
        metadata={"help": "RAM of the whole sandbox, every process and its /tmp together (a memory cgroup; "
                          "without one, each process's address space is capped at total / processes)"})
    processes: int = attrs.field(default=16, validator=_positive,
                                 metadata={"help": "processes and threads at once (RLIMIT_NPROC)"})
    file_size_bytes: int = attrs.field(default=8 * MIB, validator=_positive,
                                       metadata={"help": "largest file the program may write (RLIMIT_FSIZE)"})
    disk_bytes: int = attrs.field(default=32 * MIB, validator=_positive,
                                  metadata={"help": "size of the private /tmp tmpfs, the only writable place"})
    max_files: int = attrs.field(default=512, validator=_positive,
                                 metadata={"help": "files and directories the private /tmp may hold"})
    open_files: int = attrs.field(default=64, validator=_positive,
                                  metadata={"help": "open file descriptors per process (RLIMIT_NOFILE)"})
    output_bytes: int = attrs.field(default=1 * MIB, validator=_positive,
                                    metadata={"help": "stdout and stderr caps each; the run is killed past them"})
    uid_base: int = attrs.field(default=1_000_000, validator=_positive,
                                metadata={"help": "when root: the program runs as uid_base + launcher pid"})
    site_packages: bool = attrs.field(
        default=False, validator=lambda instance, attribute, value: _boolean(attribute, value), metadata={"help": "show the site-packages under the visible paths (third-party libraries); off: "
                                         "the standard library only, and no installed package's data (answer keys)"})
    visible_paths: tuple[str, ...] = attrs.field(
        default=("/usr", "/bin", "/lib", "/lib64", "/lib32", "/libx32", "/sbin"),
        converter=tuple, validator=_absolute_paths,
        metadata={"help": "host directories the program can read (plus its interpreter); nothing else exists "
                          "inside, so keep answer keys and tests out of them"},
    )
