"""``skyrl_core.openmp_teams``: a thread's OpenMP team is its own until it releases it.

The teams are counted as the process's OS threads (``/proc/self/task``), in a fresh process with
two OpenMP threads: every team of two adds one worker thread.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from skyrl_core import openmp_teams

pytestmark = pytest.mark.skipif(openmp_teams._libgomp() is None, reason="torch does not run on libgomp here: nothing to release")

# Prints the OS threads at the start, after main computed (a team), after main's release (with
# "release"), and while a second thread computes (its own team). (A thread's team ends when it
# exits, but its workers leave a moment later: not counted here.)
PROBE = """
import os, sys, threading, torch
from skyrl_core.openmp_teams import release_thread_team
tasks = lambda: len(os.listdir("/proc/self/task"))
def compute():
    torch.ones(1 << 20).exp_()  # above torch's grain size: one parallel region on 2 threads
start = tasks()
compute()
main_team = tasks()
if "release" in sys.argv:
    assert release_thread_team()
released = tasks()
seen = {}
def other():
    compute()
    seen["other"] = tasks()
t = threading.Thread(target=other)
t.start(); t.join()
print(start, main_team, released, seen["other"])
"""


def _probe(*args: str) -> list[int]:
    env = {**os.environ, "OMP_NUM_THREADS": "2"}
    out = subprocess.run([sys.executable, "-c", PROBE, *args], capture_output=True, text=True, env=env, check=True)
    return [int(v) for v in out.stdout.split()]


def test_a_released_team_is_gone_and_the_next_thread_builds_only_its_own():
    start, main_team, released, other = _probe("release")
    assert main_team == start + 1  # main's team: one worker beside main
    assert released == start  # released: the worker is gone
    assert other == start + 2  # the second thread and its one worker, and no other team


def test_without_release_the_main_threads_team_outlives_its_work():
    # The negative control: the same run without the release keeps main's worker beside the other
    # thread's team (two teams of two on two cores: libgomp throttles both).
    start, main_team, released, other = _probe()
    assert main_team == released == start + 1
    assert other == start + 3


def test_release_is_harmless_and_repeatable_on_a_thread_without_a_team():
    assert openmp_teams.release_thread_team() is True
    assert openmp_teams.release_thread_team() is True


# A second libgomp mapped before the first release (sentencepiece's wheel bundles one; it loads
# with a tokenizer): the probe maps a renamed copy of torch's own, then releases main's team.
SECOND_COPY = """
import ctypes, os, shutil, sys, tempfile, torch
from skyrl_core import openmp_teams
torch_gomp = os.path.join(openmp_teams.torch_lib_dir(), "libgomp.so.1")
copy = os.path.join(tempfile.mkdtemp(), "libgomp-bundled.so.1")
shutil.copy(torch_gomp, copy)
ctypes.CDLL(copy)
mapped = {line.split(None, 5)[-1].strip() for line in open("/proc/self/maps") if "/libgomp" in line}
tasks = lambda: len(os.listdir("/proc/self/task"))
torch.ones(1 << 20).exp_()
team = tasks()
released = openmp_teams.release_thread_team()
print(len(mapped), team - tasks(), released, openmp_teams._libgomp()._name == torch_gomp)
"""


def test_a_second_libgomp_in_the_process_does_not_stop_the_release_of_torchs_teams():
    env = {**os.environ, "OMP_NUM_THREADS": "2"}
    out = subprocess.run([sys.executable, "-c", SECOND_COPY], capture_output=True, text=True, env=env, check=True)
    copies, freed, released, torchs = out.stdout.split()
    assert copies == "2"  # the precondition: two runtimes mapped (before the fix: nothing released)
    assert released == "True" and torchs == "True"
    assert freed == "1"  # main's worker is gone
