"""IsoExec inside vLLM: the trainer's canonical ops installed in vLLM's own processes.

Importing this package imports nothing heavy; ``worker_init`` is what skyrl-isoexec's
``skyrl_worker_init`` hook calls. The modules below it import vLLM:

- ``install``: what is installed and when (the entry point: ``install.install()``);
- ``layers``: RMSNorm, SiluAndMul, RotaryEmbedding replacements (``CustomOp.register_oot``);
- ``linear``: linear / lm_head / embedding methods on the canonical GEMM;
- ``attention``: the ``CPU_ATTN`` replacement with its own KV cache;
- ``sampler``: ``Sampler.compute_logprobs`` on the canonical log-softmax;
- ``checks``: refusals and the inspection of the built model;
- ``runtime``: this process's ledger and current site.
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
