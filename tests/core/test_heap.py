"""``skyrl_core.heap``: the allocator thresholds are set once per process, and can be turned off."""

from __future__ import annotations

import subprocess
import sys

import pytest

from skyrl_core import heap

pytestmark = pytest.mark.skipif(heap._libc() is None, reason="not glibc: the heap tuning does nothing here")

PROBE = (
    "import ctypes, torch, time\n"
    "import sys\n"
    "from skyrl_core.heap import keep_freed_memory, set_mmap_threshold\n"
    "applied = keep_freed_memory()\n"
    "if len(sys.argv) > 1: set_mmap_threshold(int(sys.argv[1]))\n"
    "class Info(ctypes.Structure):\n"
    "    _fields_ = [(n, ctypes.c_size_t) for n in ('arena','ordblks','smblks','hblks','hblkhd','usmblks','fsmblks','uordblks','fordblks','keepcost')]\n"
    "mallinfo2 = ctypes.CDLL('libc.so.6').mallinfo2\n"
    "mallinfo2.restype = Info\n"
    "before = mallinfo2().hblks\n"
    "x = torch.ones(4 << 20)\n"  # 16 MiB: above glibc's initial mmap threshold
    "print(applied, mallinfo2().hblks - before)\n"
)


def _probe(env_value: str | None, *threshold: str) -> tuple[bool, int]:
    import os

    env = {k: v for k, v in os.environ.items() if k != "SKYRL_HEAP_TUNING"}
    if env_value is not None:
        env["SKYRL_HEAP_TUNING"] = env_value
    out = subprocess.run([sys.executable, "-c", PROBE, *threshold], capture_output=True, text=True, env=env, check=True).stdout.split()
    return out[0] == "True", int(out[1])


def test_large_tensors_come_from_the_heap_unless_turned_off():
    applied, mmapped = _probe(None)
    assert applied and mmapped == 0  # the 16 MiB tensor is a heap block, reusable after free
    applied, mmapped = _probe("0")
    assert not applied and mmapped == 1  # negative control: glibc's default mmaps it


def test_a_lower_mmap_threshold_maps_larger_tensors_again():
    """trainer.heap_mmap_threshold_mib: 16 MiB is at or above 4 MiB, so it gets its own map; at 32 MiB
    (negative control) it stays a heap block."""
    assert _probe(None, "4") == (True, 1)
    assert _probe(None, "32") == (True, 0)


RELEASE_PROBE = (
    "import sys, torch\n"
    "from skyrl_core.heap import keep_freed_memory, release_freed_memory\n"
    "keep_freed_memory()\n"
    "def rss(): return int(open('/proc/self/statm').read().split()[1]) * 4096\n"
    "xs = [torch.ones(1 << 20) for _ in range(64)]\n"  # 64 x 4 MiB heap blocks, touched
    "del xs\n"
    "kept = rss()\n"
    "if sys.argv[1] == 'release': release_freed_memory()\n"
    "print(kept - rss())\n"
)


def test_release_hands_the_kept_pages_back():
    def freed(mode: str) -> int:
        return int(subprocess.run([sys.executable, "-c", RELEASE_PROBE, mode], capture_output=True, text=True,
                                  check=True).stdout.split()[-1])

    assert freed("release") > 128 << 20  # most of the 256 MiB the tuned heap kept
    assert freed("keep") < 32 << 20  # negative control: without the release they stay resident
