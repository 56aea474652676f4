"""Held-out evaluation: accuracy and pass@n of the current policy on the eval rows."""

from __future__ import annotations

from typing import Any, Callable, Sequence

from skyrl_core.rollout import RolloutGenerator, Sampling, request_seed


def evaluate(
    generator: RolloutGenerator,
    rows: Sequence[dict[str, Any]],
    sampling: Sampling,
    *,
    seed: int,
    chunk_size: int = 64,
    on_chunk: Callable[[int], None] | None = None,
) -> dict[str, float]:
    """``eval/accuracy`` (mean over every sample), ``eval/pass@n`` (share of prompts with at least
    one correct sample among ``sampling.n``), ``eval/reward_mean`` and ``eval/response_length``.

    Rows go to the engine ``chunk_size`` at a time (``on_chunk(rows_done)`` after each chunk).
    """
    correct: list[bool] = []
    solved: list[bool] = []
    rewards: list[float] = []
    lengths: list[int] = []
    for start in range(0, len(rows), chunk_size):
        chunk = rows[start:start + chunk_size]
        trajectories = generator.generate(chunk, sampling, seed=request_seed(seed, start), group_prefix=f"eval{start}:")
        for g in range(len(chunk)):
            group = trajectories[g * sampling.n:(g + 1) * sampling.n]
            correct.extend(t.correct for t in group)
            solved.append(any(t.correct for t in group))
            rewards.extend(t.reward for t in group)
            lengths.extend(t.model_token_count for t in group)
        if on_chunk is not None:
            on_chunk(min(start + chunk_size, len(rows)))
    if not correct:
        return {}
    return {
        "eval/accuracy": sum(correct) / len(correct),
        f"eval/pass@{sampling.n}": sum(solved) / len(solved),
        "eval/reward_mean": sum(rewards) / len(rewards),
        "eval/response_length": sum(lengths) / len(lengths),
    }
