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

MARKER = "SKYRL_SGLANG_WORKER"
ENTRY_POINT_NAME = "skyrl"

logger = logging.getLogger(__name__)

_initialized_pid: int | None = None


def marker_set() -> bool:
    return os.environ.get(MARKER) == "1"


def sglang_plugins_allowlist_problem() -> str | None:
    """Why SGLang would skip this bootstrap under the current ``SGLANG_PLUGINS``, or None if it will run."""
    allow = os.environ.get("SGLANG_PLUGINS")
    if not allow:  # SGLang treats an empty allowlist as "load everything"
        return None
    if ENTRY_POINT_NAME in {n.strip() for n in allow.split(",")}:
        return None
    return (
        f"SGLANG_PLUGINS={allow!r} does not include {ENTRY_POINT_NAME!r}, so SGLang would skip skyrl's worker "
        f"bootstrap and plugins (e.g. IsoExec) would not run inside SGLang; add {ENTRY_POINT_NAME!r} or unset it"
    )


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
