"""pytest fixtures every skyrl package can use (registered through the ``pytest11`` entry point).

Installing skyrl-core must not change anyone else's test runs, so this plugin only *offers*
fixtures (``fresh_plugin_manager``, ``builtin_plugin_manager``, ``ray_session``). The test environment of skyrl's
own suites (offline Hugging Face, Ray without auth, isolated vLLM cache, ``gpu`` tests skipped
without CUDA) applies only to a project that opts in from its pytest config::

    [tool.pytest.ini_options]
    skyrl_test_environment = true
"""

from __future__ import annotations

from typing import Iterator

import pytest

from skyrl_core.plugins.manager import SkyrlPluginManager, new_plugin_manager, set_plugin_manager

OPT_IN = "skyrl_test_environment"


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


@pytest.fixture(scope="module")
def ray_session() -> Iterator[None]:
    """A local Ray session on loopback (``skyrl_core.local_ray``, two CPUs) for a module whose
    backends or engines run as Ray actors; shut down after the module."""
    import ray

    from skyrl_core.local_ray import ensure_local_ray

    ensure_local_ray(2)
    yield
    ray.shutdown()


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addini(OPT_IN, type="bool", default=False,
                  help="skyrl: offline, quiet test environment and `gpu` tests skipped without CUDA")


def pytest_configure(config: pytest.Config) -> None:
    if config.getini(OPT_IN):
        config.addinivalue_line("markers", "gpu: needs a CUDA GPU (skipped without one)")
        config.pluginmanager.import_plugin("skyrl_core.testing.suite_environment")
