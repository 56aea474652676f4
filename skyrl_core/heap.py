"""The process heap on CPU: keep freed tensor memory for reuse within a step, give it back after.

glibc serves allocations above its mmap threshold (128 KiB at start, adapting up to 32 MiB) with
``mmap`` and returns them with ``munmap`` on free. A training step on a CPU allocates and frees
thousands of activation tensors of a few MiB; each one is then fresh pages that fault on first
touch, and elementwise kernels run at page-fault speed. Raising the mmap and trim thresholds
keeps freed blocks in the heap, where the next tensor of the same size reuses them: an FSDP
``forward_backward`` of a SmolLM2-width model on 2 cores runs 1.6x faster on an idle machine (2-3x
on a busy one; ``benchmarks/cpu_gemm.py`` runs both in child processes). ``release_freed_memory`` gives the pages back between steps, so the resident size
does not keep a step's peak.

``SKYRL_HEAP_TUNING=0`` leaves the allocator alone. ``trainer.heap_mmap_threshold_mib``
(``set_mmap_threshold``) trades some of the speed for memory: larger blocks get their own maps. Not glibc (musl, macOS): nothing happens.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import os
from typing import Iterator

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD = 1 << 30
MMAP_THRESHOLD_MAX = 32 << 20  # glibc's DEFAULT_MMAP_THRESHOLD_MAX on 64-bit
TRIM_THRESHOLD = 1 << 30


@functools.cache
def _libc() -> ctypes.CDLL | None:
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.mallopt  # noqa: B018 - glibc has it, musl's libc.so.6 does not exist
        libc.malloc_trim  # noqa: B018
        return libc
    except (OSError, AttributeError):
        return None


@functools.cache
def keep_freed_memory() -> bool:
    """Raise glibc's mmap and trim thresholds for this process (once); True when applied."""
    libc = _libc()
    if libc is None or os.environ.get("SKYRL_HEAP_TUNING", "1") == "0":
        return False
    ok = _set_configured_mmap_threshold(libc)
    return bool(libc.mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD) == 1 and ok)


def _set_configured_mmap_threshold(libc: ctypes.CDLL) -> bool:
    """This process's mmap threshold: ``SKYRL_HEAP_MMAP_MIB`` (``trainer.heap_mmap_threshold_mib``)
    or ``MMAP_THRESHOLD``. Newer glibc refuses thresholds above its maximum instead of clamping:
    then the maximum."""
    threshold = int(os.environ.get("SKYRL_HEAP_MMAP_MIB", "0")) << 20 or MMAP_THRESHOLD
    return libc.mallopt(_M_MMAP_THRESHOLD, threshold) == 1 or libc.mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD_MAX) == 1


def set_mmap_threshold(mib: int) -> bool:
    """Serve allocations of at least ``mib`` MiB with their own memory map again (returned to the OS
    when freed) for this process and the rank processes it starts later (``SKYRL_HEAP_MMAP_MIB``);
    smaller ones keep reusing heap blocks. A training step frees and re-allocates tensors of many
    sizes; in the heap they fragment it, and its resident size stays at the high-water mark (for
    SmolLM2 about twice the live tensors). True when applied."""
    os.environ["SKYRL_HEAP_MMAP_MIB"] = str(int(mib))
    libc = _libc()
    if libc is None or os.environ.get("SKYRL_HEAP_TUNING", "1") == "0":
        return False
    return libc.mallopt(_M_MMAP_THRESHOLD, int(mib) << 20) == 1


@contextlib.contextmanager
def own_maps_above(mib: int) -> Iterator[None]:
    """Inside the block, allocations of at least ``mib`` MiB get their own memory map (given back
    when freed); after it, the process's threshold again. For a computation of a few very large
    tensors of changing sizes (a long sequence's attention scores, ``[heads, T, T]``): kept in the
    heap they fragment it, and the resident size grows to several times the live tensors (a
    2048-token LoRA pass on SmolLM2: 4.8 GiB against 1.5 with maps above 32 MiB)."""
    libc = _libc()
    if libc is None or not keep_freed_memory():
        yield
        return
    libc.mallopt(_M_MMAP_THRESHOLD, int(mib) << 20)
    try:
        yield
    finally:
        _set_configured_mmap_threshold(libc)


def release_freed_memory() -> None:
    """Hand the heap's free pages back to the OS (between steps: a step's peak is not kept)."""
    libc = _libc()
    if libc is not None:
        libc.malloc_trim(0)
