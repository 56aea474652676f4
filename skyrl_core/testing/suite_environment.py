"""The test environment of skyrl's own suites, loaded by ``skyrl_core.testing.pytest_plugin`` only
for projects that set ``skyrl_test_environment = true``: offline Hugging Face, Ray without auth, an
isolated vLLM cache, ``SKYRL_*`` variables restored after each test, and ``gpu`` tests skipped
without CUDA."""

from __future__ import annotations

import os
from typing import Iterator

import pytest

from skyrl_core.local_ray import adopt_skyrl_environment, skyrl_environment


@pytest.fixture(autouse=True, scope="session")
def _skyrl_test_environment(tmp_path_factory: pytest.TempPathFactory) -> None:
    """Offline, quiet, isolated caches for every test session."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ.setdefault("VLLM_CACHE_ROOT", str(tmp_path_factory.mktemp("vllm-cache")))
    # skyrl's own per-machine answers (cpu_gemm: auto) go to a session directory, not ~/.cache
    os.environ.setdefault("SKYRL_CACHE_DIR", str(tmp_path_factory.mktemp("skyrl-cache")))


@pytest.fixture(autouse=True)
def _skyrl_variables_restored() -> Iterator[None]:
    """Each test leaves the ``SKYRL_*`` variables as it found them. They switch plugins on in this
    process and in every process it starts, and tests run in any order across workers
    (``pytest -n``), so one test's leftover would change what an unrelated later test computes."""
    before = skyrl_environment()
    yield
    adopt_skyrl_environment(before)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    gpu_items = [item for item in items if "gpu" in item.keywords]
    if not gpu_items:
        return
    try:
        import torch

        has_cuda = torch.cuda.is_available()
    except Exception:
        has_cuda = False
    if has_cuda:
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (marked gpu); run scripts/gpu_check.sh on a GPU machine")
    for item in gpu_items:
        item.add_marker(skip)
