"""skyrl's bootstrap inside vLLM's own processes.

vLLM calls every function of the entry-point group ``vllm.general_plugins`` once in each of its
processes (front-end, engine core, every worker) before it builds the model. skyrl registers
``register`` there. It does nothing unless the marker ``SKYRL_VLLM_WORKER=1`` is in the environment
(``VLLMEngine`` sets it before starting vLLM; spawned processes inherit it), so installing
skyrl-vllm never changes a vLLM that skyrl did not start. With the marker it builds skyrl's plugin
manager in that process, calls ``skyrl_worker_init(role="engine", engine="vllm")`` and installs skyrl's op
sites in vLLM's layers (``skyrl_vllm.op_sites``: vLLM's own kernels unless a plugin installs
another implementation of an op), once per process. Every model load there also offers its two
moments to the plugins (``skyrl_engine_model_loading``, ``skyrl_engine_model_loaded``), routing on or off.
"""

from __future__ import annotations

import os

from skyrl_core.engines import bootstrap as shared

MARKER = "SKYRL_VLLM_WORKER"
# "0" leaves vLLM's layers without skyrl's op sites (benchmarks/isoexec_vllm.py measures both); the
# model-load hooks still run.
OP_SITES_SWITCH = "SKYRL_VLLM_OP_SITES"
ENTRY_POINT_NAME = shared.ENTRY_POINT_NAME

_BOOTSTRAP = shared.WorkerBootstrap(engine="vllm", marker=MARKER)


def marker_set() -> bool:
    return shared.marker_set(MARKER)


def vllm_plugins_allowlist_problem() -> str | None:
    """Why vLLM would skip this bootstrap under the current ``VLLM_PLUGINS`` (set but empty: vLLM
    loads no plugin), or None if it will run."""
    return shared.allowlist_problem("VLLM_PLUGINS", "vLLM", empty_loads_all=False)


def register() -> None:
    """vLLM general-plugin entry point. Idempotent; inert without the marker."""
    if not _BOOTSTRAP.begin():
        return
    _BOOTSTRAP.init_plugins()
    from skyrl_vllm import op_sites

    op_sites.install(route=os.environ.get(OP_SITES_SWITCH, "1") != "0")


def ran_in_this_process() -> bool:
    """Whether ``register`` initialised skyrl in the calling process."""
    return _BOOTSTRAP.ran_in_this_process()
