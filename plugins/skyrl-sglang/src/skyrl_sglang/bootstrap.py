"""skyrl's bootstrap inside SGLang's own processes.

SGLang calls every function of the entry-point group ``sglang.srt.plugins`` once in each of its
processes (``sglang.srt.plugins.load_plugins``). skyrl registers ``register`` there. It does nothing
unless the marker ``SKYRL_SGLANG_WORKER=1`` is in the environment (``SGLangEngine`` sets it before
starting SGLang; spawned processes inherit it); with the marker it builds skyrl's plugin manager in
that process, calls ``skyrl_worker_init(role="engine", engine="sglang")`` and installs skyrl's op sites in SGLang's
layers (``skyrl_sglang.op_sites``), once per process.
"""

from __future__ import annotations

import sys

from skyrl_core.engines import bootstrap as shared

MARKER = "SKYRL_SGLANG_WORKER"
ENTRY_POINT_NAME = shared.ENTRY_POINT_NAME

_BOOTSTRAP = shared.WorkerBootstrap(engine="sglang", marker=MARKER)


def marker_set() -> bool:
    return shared.marker_set(MARKER)


def sglang_plugins_allowlist_problem() -> str | None:
    """Why SGLang would skip this bootstrap under the current ``SGLANG_PLUGINS`` (empty: SGLang loads
    every plugin), or None if it will run."""
    return shared.allowlist_problem("SGLANG_PLUGINS", "SGLang", empty_loads_all=True)


def register() -> None:
    """SGLang general-plugin entry point. Idempotent; inert without the marker."""
    if not _BOOTSTRAP.begin():
        return
    _BOOTSTRAP.init_plugins()
    if "sglang" in sys.modules:  # SGLang's own loader called us (tests call the bootstrap directly)
        from skyrl_sglang import op_sites

        op_sites.install()


def ran_in_this_process() -> bool:
    return _BOOTSTRAP.ran_in_this_process()
