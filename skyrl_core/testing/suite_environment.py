"""The test environment of skyrl's own suites, loaded by ``skyrl_core.testing.pytest_plugin`` only
for projects that set ``skyrl_test_environment = true``: offline Hugging Face, Ray without auth, an
isolated vLLM cache, and ``gpu`` tests skipped without CUDA."""

from __future__ import annotations

import os

import pytest


@pytest.fixture(autouse=True, scope="session")
def _skyrl_test_environment(tmp_path_factory: pytest.TempPathFactory) -> None:
    """Offline, quiet, isolated caches for every test session."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ.setdefault("VLLM_CACHE_ROOT", str(tmp_path_factory.mktemp("vllm-cache")))


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
