"""IsoExec inside vLLM: what computes over vLLM's own state, on the canonical kernels.

vLLM's linear, lm_head, embedding, norm, SiLU-and-mul, rotary and sampler-logprob layers reach
IsoExec's canonical kernels through skyrl-vllm's op sites (``skyrl_vllm.op_sites``), which call
the implementations IsoExec's ``skyrl_install_op`` hook installs; nothing here replaces them.
Importing this package imports nothing heavy; ``worker_init`` is what skyrl-isoexec's
``skyrl_worker_init`` hook calls. The modules below it import vLLM:

- ``install``: what is installed and when (the entry point: ``install.install()``);
- ``attention``: the ``CPU_ATTN`` replacement with its own KV cache (``CUSTOM`` on CUDA);
- ``moe``: the MoE runner over the plain expert weights;
- ``gdn``: Qwen3-Next's GatedDeltaNet layer over vLLM's state cache;
- ``checks``: refusals and the inspection of the built model;
- ``runtime``: this process's ledger and current step.
"""

from __future__ import annotations

import sys


def worker_init(role: str) -> bool:
    """Install the canonical ops into this process's vLLM, if it has one; return whether it did.

    skyrl's vLLM bootstrap calls this (through ``skyrl_worker_init``) in every vLLM process that
    skyrl starts, once per process. The installed replacements stay inert for engines built while
    IsoExec is off (see ``install``). A process without vLLM (a trainer, another engine) is left alone.
    """
    if role != "engine" or "vllm" not in sys.modules:
        return False
    from skyrl_isoexec import state
    from skyrl_isoexec.vllm.install import install

    install(strict=state.enabled())
    return True
