"""vLLM's logprobs (``Sampler.compute_logprobs``) on the canonical log-softmax.

vLLM computes every returned logprob (sampled tokens, top-k, prompt logprobs) with
``Sampler.compute_logprobs(logits)`` on the raw model logits (``logprobs_mode="raw_logprobs"``),
as a full ``[rows, vocab]`` matrix that it gathers from. ``kernels.logprobs.full_log_softmax`` is
the matrix the trainer's ``token_logprobs`` gathers from too, so the bits agree (tested).
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from skyrl_isoexec.kernels.logprobs import full_log_softmax
from skyrl_isoexec.vllm import runtime

_original: list[Callable[..., Any]] = []


def compute_logprobs(self, logits: torch.Tensor) -> torch.Tensor:
    """Replaces vLLM's static method; vLLM always calls it on its sampler (``self.compute_logprobs``,
    ``self.sampler.compute_logprobs``), which the model runner marked when its model was loaded."""
    if not getattr(self, "_isoexec", False):
        return _original[0](logits)
    runtime.observe("logprobs")
    return full_log_softmax(logits)


def mark(sampler: object, active: bool) -> None:
    """Make ``sampler`` (an engine's ``Sampler``) compute canonical logprobs, or vLLM's own."""
    sampler._isoexec = active


def install() -> dict[str, str]:
    from vllm.v1.sample.sampler import Sampler

    if not _original:
        _original.append(Sampler.compute_logprobs)
        Sampler.compute_logprobs = compute_logprobs
    return {"Sampler.compute_logprobs": f"{__name__}.compute_logprobs"}


def uninstall() -> None:
    from vllm.v1.sample.sampler import Sampler

    if _original:
        Sampler.compute_logprobs = staticmethod(_original.pop())
