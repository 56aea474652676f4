"""skyrl's bootstrap inside SGLang's own processes.

SGLang calls every function of the entry-point group ``sglang.srt.plugins`` once in each of its
processes (``sglang.srt.plugins.load_plugins``). skyrl registers ``register`` there. It does nothing
unless the marker ``SKYRL_SGLANG_WORKER=1`` is in the environment (``SGLangEngine`` sets it before
starting SGLang; spawned processes inherit it); with the marker it builds skyrl's plugin manager in
that process, calls ``skyrl_worker_init(role="engine", engine="sglang")`` and installs skyrl's op sites in SGLang's
layers (``skyrl_sglang.op_sites``), once per process.
"""

from __future__ import annotations

import logging
import os
import sys

from skyrl_core.engines import bootstrap as shared

MARKER = "SKYRL_SGLANG_WORKER"
ENTRY_POINT_NAME = shared.ENTRY_POINT_NAME

logger = logging.getLogger(__name__)

_initialized_pid: int | None = None


def marker_set() -> bool:
    return shared.marker_set(MARKER)


def sglang_plugins_allowlist_problem() -> str | None:
    """Why SGLang would skip this bootstrap under the current ``SGLANG_PLUGINS`` (empty: SGLang loads
    every plugin), or None if it will run."""
    return shared.allowlist_problem("SGLANG_PLUGINS", "SGLang", empty_loads_all=True)


def register() -> None:
    """SGLang general-plugin entry point. Idempotent; inert without the marker."""
    global _initialized_pid
    if not marker_set() or _initialized_pid == os.getpid():
        return
    _initialized_pid = os.getpid()
    try:
        from skyrl_core.plugins.manager import get_plugin_manager
    except ImportError as exc:  # a skyrl-core without a plugin manager cannot host plugins
        logger.warning("skyrl bootstrap in SGLang process %d: no plugin manager (%s)", os.getpid(), exc)
        return
    get_plugin_manager().hook.skyrl_worker_init(role="engine", engine="sglang")
    if "sglang" in sys.modules:  # SGLang's own loader called us (tests call the bootstrap directly)
        from skyrl_sglang import op_sites

        op_sites.install()


def ran_in_this_process() -> bool:
    return _initialized_pid == os.getpid()
