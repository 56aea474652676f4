"""Independent references for the algorithm tests: plain Python loops over floats (``math``), written
from the formulas in docs/algorithms.md, sharing no code with ``skyrl_core.algorithms``.

The fixture batch has 4 rows of 4 tokens with padding, garbage (nan/inf) at untrained positions,
extreme ratios (log-ratio +8 and -8), and both signs of advantage.
"""

from __future__ import annotations

import math

import torch

NAN, INF = float("nan"), float("inf")
LIMIT = 20.0  # the documented log-ratio clamp

MASK = [
    [1, 1, 1, 0],
    [1, 1, 0, 0],
    [1, 1, 1, 1],
    [1, 0, 0, 0],
]
OLD = [
    [-1.0, -2.0, -0.7, INF],
    [-9.0, -0.5, NAN, NAN],
    [-0.2, -0.05, -1.5, -0.3],
    [-0.4, NAN, -INF, 3.0],
]
LOGP = [
    [-1.0, -1.9, -1.05, NAN],
    [-1.0, -8.5, NAN, 0.0],
    [-0.05, -0.2, -1.0, -1.3],
    [-0.35, INF, NAN, -2.0],
]
ADV = [
    [1.0, 1.0, 1.0, 5.0],
    [-1.5, -2.0, NAN, NAN],
    [-0.5, -0.5, 0.8, 0.8],
    [0.0, NAN, 1.0, 1.0],
]
ROLLOUT = [
    [-1.1, -2.0, -2.0, NAN],
    [-9.5, -0.4, NAN, INF],
    [-0.25, -0.05, -1.0, -0.31],
    [-0.4, NAN, NAN, NAN],
]
GROUPS = ["a", "a", "a", "b"]


def tensors(dtype=torch.float64):
    """``(logprobs (requires grad), old, advantages, mask, rollout)`` of the fixture batch."""
    logp = torch.tensor(LOGP, dtype=dtype, requires_grad=True)
    return (
        logp,
        torch.tensor(OLD, dtype=dtype),
        torch.tensor(ADV, dtype=dtype),
        torch.tensor(MASK, dtype=dtype),
        torch.tensor(ROLLOUT, dtype=dtype),
    )


def trained(mask=MASK):
    return [(b, t) for b in range(len(mask)) for t in range(len(mask[0])) if mask[b][t]]


def ref_weights(mask, reduction, groups=None, norm_len=None):
    """Per-token weights of a reduction, by counting."""
    rows, cols = len(mask), len(mask[0])
    w = [[0.0] * cols for _ in range(rows)]
    lengths = [sum(row) for row in mask]
    if reduction == "token_mean":
        total = sum(lengths)
        for b, t in trained(mask):
            w[b][t] = 1 / total
    elif reduction == "sequence_mean":
        nonempty = sum(1 for n in lengths if n)
        for b, t in trained(mask):
            w[b][t] = 1 / (lengths[b] * nonempty)
    elif reduction == "seq_mean_token_sum_norm":
        for b, t in trained(mask):
            w[b][t] = 1 / (rows * (norm_len or cols))
    elif reduction == "prompt_mean":
        group_tokens: dict = {}
        for b in range(rows):
            group_tokens[groups[b]] = group_tokens.get(groups[b], 0) + lengths[b]
        nonempty = sum(1 for n in group_tokens.values() if n)
        for b, t in trained(mask):
            w[b][t] = 1 / (group_tokens[groups[b]] * nonempty)
    else:
        raise AssertionError(reduction)
    return w


def weighted_sum(per_token, weights, mask=MASK):
    return sum(per_token[b][t] * weights[b][t] for b, t in trained(mask))


def log_ratio(b, t, behaviour=OLD):
    return min(max(LOGP[b][t] - behaviour[b][t], -LIMIT), LIMIT)


def clip(x, low, high):
    return min(max(x, low), high)


def sigmoid(x):
    return 1 / (1 + math.exp(-x))
