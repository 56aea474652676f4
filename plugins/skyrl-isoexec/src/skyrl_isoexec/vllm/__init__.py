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
    """Install the canonical ops into vLLM when this is a vLLM process of an engine with IsoExec on.

    Returns whether they are installed. A process that has not imported vLLM (a trainer, another
    engine) is left alone, so this is cheap everywhere else.
    """
    from skyrl_isoexec import state

    if role != "engine" or "vllm" not in sys.modules or not state.enabled():
        return False
    from skyrl_isoexec.vllm.install import install

    install()
    return True
