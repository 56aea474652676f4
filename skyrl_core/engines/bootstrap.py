"""What engine plugins' bootstraps inside their library's processes share (skyrl-vllm's in
``vllm.general_plugins``, skyrl-sglang's in ``sglang.srt.plugins``): the marker that says skyrl
started the library (a bootstrap does nothing without it, so installing a plugin never changes a
library skyrl did not start), the check that the library's plugin allowlist lets it run, and the
model load that offers its two moments to every plugin (``load_model``).
"""

from __future__ import annotations

import os
from typing import Any, Callable, TypeVar

T = TypeVar("T")

# The bootstrap's entry-point name in the library's plugin group (what an allowlist must name).
ENTRY_POINT_NAME = "skyrl"


def marker_set(marker: str) -> bool:
    """Whether the environment variable ``marker`` is ``"1"`` (set by the engine before it starts
    the library; the library's processes inherit it)."""
    return os.environ.get(marker) == "1"


def allowlist_problem(variable: str, library: str, *, empty_loads_all: bool) -> str | None:
    """Why ``library`` would skip skyrl's bootstrap under its plugin allowlist ``variable``, or None
    if it will run. Unset loads every plugin; ``empty_loads_all`` says what an empty value does."""
    allow = os.environ.get(variable)
    if allow is None or (empty_loads_all and not allow):
        return None
    if ENTRY_POINT_NAME in {name.strip() for name in allow.split(",")}:
        return None
    return (
        f"{variable}={allow!r} does not include {ENTRY_POINT_NAME!r}, so {library} would skip skyrl's worker "
        f"bootstrap and plugins (e.g. IsoExec) would not run inside {library}; add {ENTRY_POINT_NAME!r} to "
        f"{variable} or unset it"
    )


class WorkerBootstrap:
    """The once-per-process part of an engine plugin's bootstrap in its library's processes.

    ``begin()`` is True the first time it is called in a process whose environment has ``marker``
    set (a library may load its plugins more than once per process, and a forked child must start
    over); ``init_plugins()`` then calls ``skyrl_worker_init(role="engine", engine=...)`` through
    that process's plugin manager, before the plugin installs its op sites.
    """

    def __init__(self, *, engine: str, marker: str) -> None:
        self.engine, self.marker = engine, marker
        self._pid: int | None = None

    def begin(self) -> bool:
        if not marker_set(self.marker) or self._pid == os.getpid():
            return False
        self._pid = os.getpid()
        return True

    def init_plugins(self) -> None:
        from skyrl_core.plugins.manager import get_plugin_manager

        get_plugin_manager().hook.skyrl_worker_init(role="engine", engine=self.engine)

    def ran_in_this_process(self) -> bool:
        return self._pid == os.getpid()


def load_model(engine: str, engine_config: Any, load: Callable[[], T], loaded_model: Callable[[], Any]) -> T:
    """Run ``load`` (the library's model load, with the plugin's op routing) between the model-load
    hooks: ``skyrl_engine_model_loading(engine, engine_config)`` before it, then
    ``skyrl_engine_model_loaded(engine, loaded_model())``; return what ``load`` returned. The engine
    plugin's wrapper of the library's load calls it, so no other plugin wraps that load."""
    from skyrl_core.plugins.manager import get_plugin_manager

    hook = get_plugin_manager().hook
    hook.skyrl_engine_model_loading(engine=engine, engine_config=engine_config)
    result = load()
    hook.skyrl_engine_model_loaded(engine=engine, model=loaded_model())
    return result
