"""Fixtures shared by the IsoExec tests (helpers live in ``skyrl_isoexec.parity``)."""

from __future__ import annotations

import os

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("RAY_AUTH_MODE", "disabled")


@pytest.fixture(autouse=True)
def _one_thread_unless_asked():
    """One torch thread by default: the shared CI machine is oversubscribed, and thread counts are
    the subject of their own tests (which set them explicitly)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def ray_session():
    """Ray for tests whose trainer runs as Ray ranks; shut down after the module if it started it."""
    import ray

    started = not ray.is_initialized()
    yield
    if started:
        ray.shutdown()
