"""On-policy distillation: the student samples, a teacher scores the sampled tokens, and each
token's advantage is ``teacher logprob - student logprob``.

Maximising ``E_student[A * log pi]`` with that advantage descends the reverse KL
``KL(student || teacher)`` one sampled token at a time (its per-token estimate is ``-A``). The
environment's reward may be mixed in: ``coef * (log p_teacher - log p_student) + reward_coef *
A_reward``, ``A_reward`` being the configured estimator's advantage.
"""

from __future__ import annotations

import json
import os
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from skyrl_core.config.schema import Config


def distillation_advantages(
    reward_advantages: torch.Tensor, teacher_logprobs: torch.Tensor, student_logprobs: torch.Tensor,
    mask: torch.Tensor, *, coef: float, reward_coef: float,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Per-token advantages ``[B, R]`` and ``distill/reverse_kl`` (mean over trained tokens of
    ``log p_student - log p_teacher`` on the student's own samples)."""
    gap = (teacher_logprobs - student_logprobs) * mask
    advantages = coef * gap + reward_coef * reward_advantages * mask
    tokens = mask.sum().clamp(min=1)
    return advantages, {"distill/reverse_kl": float(-gap.sum() / tokens)}


def _vocab_size(model: Any) -> int | None:
    if model.config is not None:
        return model.config.get("vocab_size")
    try:
        with open(os.path.join(os.path.expanduser(model.path), "config.json"), encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, ValueError):
        return None
    return data.get("vocab_size", (data.get("text_config") or {}).get("vocab_size"))


def teacher_problems(cfg: Config) -> list[str]:
    """Why ``algorithm.distillation.teacher`` cannot teach this student (empty: it can): it must be
    a Hugging Face model directory with the student's vocabulary (token ids are compared one to one)."""
    from skyrl_core.config.schema import ModelConfig

    teacher = cfg.algorithm.distillation.teacher
    if teacher is None:
        return []
    if not os.path.isfile(os.path.join(os.path.expanduser(teacher), "config.json")):
        return [f"{teacher!r} is not a Hugging Face model directory (no config.json)"]
    mine, theirs = _vocab_size(cfg.model), _vocab_size(ModelConfig(path=teacher))
    if mine is not None and theirs is not None and mine != theirs:
        return [f"{teacher!r} has a vocabulary of {theirs} tokens, the student {mine}: the teacher must share the "
                "student's tokenizer"]
    return []
