"""The learning-rate schedule as a pure function of the optimizer step, shared by every backend
so that they follow the same curve for the same trainer config."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from skyrl_core.config.schema import TrainerConfig

SCHEDULES = ("constant", "cosine", "linear")


def lr_factor(step: int, *, schedule: str, warmup_steps: int, total_steps: int) -> float:
    """Multiplier of the peak LR for the optimizer step ``step`` (0-based: the first step is 0).

    Warm-up is linear and reaches the peak at step ``warmup_steps - 1`` (so the first step already
    learns). After it, ``cosine`` and ``linear`` decay to 0 at step ``total_steps``; ``constant`` stays.
    """
    if schedule not in SCHEDULES:
        raise ValueError(f"lr_schedule must be one of {', '.join(SCHEDULES)}; got {schedule!r}")
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    if schedule == "constant":
        return 1.0
    progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
    if schedule == "cosine":
        return 0.5 * (1.0 + math.cos(math.pi * progress))
    return 1.0 - progress


def scheduled_lr(trainer: "TrainerConfig", step: int, total_steps: int) -> float:
    """The trainer config's learning rate at optimizer step ``step`` of ``total_steps``: its peak
    ``lr`` times ``lr_factor`` of its schedule and warm-up."""
    return trainer.lr * lr_factor(step, schedule=trainer.lr_schedule, warmup_steps=trainer.warmup_steps, total_steps=total_steps)
