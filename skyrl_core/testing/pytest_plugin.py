"""pytest fixtures every skyrl package can use (registered through the ``pytest11`` entry point)."""

from __future__ import annotations

import os
from typing import Iterator

import pytest

from skyrl_core.plugins.manager import SkyrlPluginManager, new_plugin_manager, set_plugin_manager


@pytest.fixture
def fresh_plugin_manager() -> Iterator[SkyrlPluginManager]:
    """A new plugin manager (built-ins + installed plugins) installed as the process-wide one for
    the test; register test plugins on it with ``pm.register_plugin(obj, name)``."""
    pm = new_plugin_manager()
    previous = set_plugin_manager(pm)
    try:
        yield pm
    finally:
        set_plugin_manager(previous)


@pytest.fixture
def builtin_plugin_manager() -> Iterator[SkyrlPluginManager]:
    """Like ``fresh_plugin_manager`` but with only the core's built-ins (no entry points)."""
    pm = new_plugin_manager(autoload=False)
    previous = set_plugin_manager(pm)
    try:
        yield pm
    finally:
        set_plugin_manager(previous)


@pytest.fixture(autouse=True, scope="session")
def _skyrl_test_environment(tmp_path_factory: pytest.TempPathFactory) -> None:
    """Offline, quiet, isolated caches for every test session."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ.setdefault("VLLM_CACHE_ROOT", str(tmp_path_factory.mktemp("vllm-cache")))


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "gpu: needs a CUDA GPU (skipped without one)")


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
