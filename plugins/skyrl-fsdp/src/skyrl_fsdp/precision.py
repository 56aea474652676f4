"""The dtype the FSDP trainer computes in follows ``model.dtype``, the one user-facing switch.

``model.dtype: bfloat16`` makes the engine hold bf16 weights and the trainer compute its forward and
backward in bf16 (FSDP2 gathers the fp32 master weights as bf16; gradients reduce and the optimizer
steps in fp32; logprobs and the loss are computed in fp32). ``backend.options.mixed_precision``
defaults to ``auto`` (follow ``model.dtype``); an explicit value must agree with it, because a
trainer scoring in another dtype than the engine samples in trains off-policy without saying so.
Light: no torch import (the pre-flight check runs before any work).
"""

from __future__ import annotations

from typing import Any

import attrs

PRECISION_OF_DTYPE = {"float32": "fp32", "bfloat16": "bf16"}


def compute_precision(options: Any, model_dtype: str) -> str:
    """``fp32`` or ``bf16``: ``options.mixed_precision`` with ``auto`` resolved from ``model.dtype``."""
    if options.mixed_precision == "auto":
        return PRECISION_OF_DTYPE[model_dtype]
    return options.mixed_precision


def with_model_precision(options: Any, model: Any) -> Any:
    """``options`` with ``mixed_precision`` resolved (what the ranks and the execution contract see)."""
    return attrs.evolve(options, mixed_precision=compute_precision(options, model.dtype))


def contradiction(mixed_precision: str, model_dtype: str, *, key: str = "backend.options.mixed_precision") -> str | None:
    """The sentence refusing ``mixed_precision`` beside ``model.dtype``, or None when they agree."""
    wanted = PRECISION_OF_DTYPE[model_dtype]
    if mixed_precision in ("auto", wanted):
        return None
    other = next(d for d, p in PRECISION_OF_DTYPE.items() if p == mixed_precision)
    return (
        f"{key}: {mixed_precision!r} contradicts model.dtype: {model_dtype!r} (the engine would sample in "
        f"{model_dtype} while the trainer computes in {other}); model.dtype chooses both: leave {key} out "
        f"(auto follows model.dtype), or set model.dtype: {other} for {mixed_precision} compute"
    )


def problems(config: Any, options: Any) -> list[str]:
    """Pre-flight check of the ``fsdp`` backend: its compute precision agrees with ``model.dtype``."""
    problem = contradiction(options.mixed_precision, config.model.dtype)
    return [problem] if problem else []
