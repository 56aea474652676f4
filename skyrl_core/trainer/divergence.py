"""Stopping a run at the first non-finite loss, gradient norm or weight.

A NaN or inf there poisons every later step (and every checkpoint): the run stops at once, naming
the step and the value, before the optimizer applies it (backends skip the optimizer step on a
non-finite gradient norm) and before a checkpoint would save it.
"""

from __future__ import annotations

import math
from typing import Any, Iterable


class NonFiniteTrainingError(RuntimeError):
    """Training produced NaN or inf; the run stopped without applying or saving it."""


def check_finite(step: int, what: str, value: Any) -> None:
    """Raise ``NonFiniteTrainingError`` if ``value`` (a number, or None for "not reported") is NaN or inf."""
    if value is None or math.isfinite(float(value)):
        return
    raise NonFiniteTrainingError(
        f"training step {step}: the {what} is {float(value)} (not finite); the run stopped before the optimizer "
        "applied it and without checkpointing. Lower trainer.lr, check the rewards and the data, or use "
        "model.dtype: float32"
    )


def check_weights_finite(step: int, weights: Iterable[tuple[str, Any]]) -> None:
    """Raise ``NonFiniteTrainingError`` naming the first weight with a NaN or inf entry."""
    import torch

    for name, tensor in weights:
        if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
            raise NonFiniteTrainingError(
                f"training step {step}: weight {name!r} holds NaN or inf after the optimizer step (the update "
                "overflowed); the run stopped without checkpointing it. Lower trainer.lr"
            )
