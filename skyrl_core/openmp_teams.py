"""Each thread's OpenMP worker team, and why a thread that hands its computing to another gives its
team back.

torch's CPU kernels (its own, MKL's and oneDNN's) run their parallel regions on the GNU OpenMP
runtime (libgomp) that ships with the Linux wheel. libgomp gives every thread that starts a
parallel region a team of worker threads of its own, kept until that thread exits. Once the
workers of all the teams alive outnumber the cores, libgomp throttles them: between two regions a
worker spins 100 times instead of 300,000, then sleeps in the kernel, so each later region waits
for the kernel to wake it. A process in which a second thread starts computing after the main
thread has computed (a server that loads its model on the main thread and works on another, an
engine driven from a thread pool) then runs every small kernel several times slower, for good: on
2 cores a [64, 64] x [64, 512] product took 150-200 us on the second thread against 40-50 us on
either thread alone (``tests/core/test_openmp_teams.py`` shows the teams; the Tinker server's
sampling phase is the benchmark, ``docs/benchmarks.md``).

``release_thread_team()`` ends the calling thread's team (OpenMP 5's ``omp_pause_resource_all``;
libgomp frees the calling thread's pool and nothing else). A thread calls it when it stops
computing and another thread starts: the next parallel region on it builds a new team, which costs
a thread start per worker (tens of microseconds). Where torch does not use libgomp (macOS, LLVM or
Intel OpenMP builds, whose waiting policies differ) it does nothing.
"""

from __future__ import annotations

import ctypes
import functools
import os
import sys

OMP_PAUSE_HARD = 2  # omp_pause_resource_t: omp_pause_soft = 1, omp_pause_hard = 2


@functools.cache
def _libgomp() -> ctypes.CDLL | None:
    """The libgomp torch loaded (already mapped into this process), or None."""
    if not sys.platform.startswith("linux"):
        return None
    import torch  # noqa: F401 - the runtime to find is the one torch loads

    try:
        with open("/proc/self/maps") as maps:
            paths = {line.split(None, 5)[-1].strip() for line in maps if "/libgomp" in line}
    except OSError:
        return None
    # Other wheels bundle a libgomp of their own (sentencepiece's, loaded with a tokenizer): their
    # teams are theirs. torch's kernels run on the copy in torch's own lib directory.
    paths = {path for path in paths if torch_lib_dir() in path} or paths
    if len(paths) != 1:  # none (another OpenMP runtime), or two copies and neither torch's: do not guess
        return None
    try:
        lib = ctypes.CDLL(paths.pop(), mode=os.RTLD_NOLOAD | os.RTLD_LAZY)
        pause = lib.omp_pause_resource_all
    except (OSError, AttributeError):  # a libgomp older than OpenMP 5 (GCC 9)
        return None
    pause.argtypes, pause.restype = [ctypes.c_int], ctypes.c_int
    return lib


def torch_lib_dir() -> str:
    """The directory of torch's shared libraries (``.../torch/lib/``)."""
    import torch

    return os.path.join(os.path.dirname(torch.__file__), "lib") + os.sep


def release_thread_team() -> bool:
    """End the calling thread's OpenMP worker team (see the module's description); True if the
    runtime took the call (also when the thread had no team), False where there is no libgomp."""
    lib = _libgomp()
    return lib is not None and lib.omp_pause_resource_all(OMP_PAUSE_HARD) == 0
