"""Length-sorted, trimmed micro-batches: less padding in every forward pass.

A step's batch is padded to its longest prompt and longest response; most rows are shorter. Rows
sorted by length and cut into micro-batches, each trimmed to its own longest prompt and response,
cost the forward and backward passes only the padding of their neighbours. Token weights are
computed on the whole mini-batch before cutting, so the micro-batch losses still sum exactly to
the mini-batch's loss.
"""

from __future__ import annotations

import attrs
import torch

from skyrl_core.types import TrainingBatch

_RESPONSE_FIELDS = ("loss_mask", "advantages", "returns", "old_logprobs", "rollout_logprobs", "ref_logprobs",
                    "values", "token_weights")


def trim(batch: TrainingBatch) -> TrainingBatch:
    """``batch`` without columns that are padding in every row (left of the prompts, right of the
    responses); at least one response column stays."""
    P, R = batch.prompt_len, batch.response_len
    real = batch.attention_mask.bool()
    prompt_cols = real[:, :P].any(0).nonzero()
    first = int(prompt_cols[0]) if len(prompt_cols) else P - 1
    response_cols = real[:, P:].any(0).nonzero()
    keep = max(1, int(response_cols[-1]) + 1 if len(response_cols) else 1)
    if first == 0 and keep == R:
        return batch
    changes = {"input_ids": batch.input_ids[:, first:P + keep], "attention_mask": batch.attention_mask[:, first:P + keep]}
    for name in _RESPONSE_FIELDS:
        value = getattr(batch, name)
        if value is not None:
            changes[name] = value[:, :keep]
    return attrs.evolve(batch, **changes)


def length_sorted_chunks(batch: TrainingBatch, chunk_size: int) -> list[tuple[list[int], TrainingBatch]]:
    """``(row indices, trimmed sub-batch)`` pairs covering ``batch``: rows ordered by prompt and
    response length (a stable order, so the result depends only on the batch), ``chunk_size`` rows each."""
    P = batch.prompt_len
    prompt_lens = batch.attention_mask[:, :P].sum(-1).tolist()
    response_lens = batch.attention_mask[:, P:].sum(-1).tolist()
    order = sorted(range(len(batch)), key=lambda i: (response_lens[i], prompt_lens[i]))
    return [(rows, trim(batch.select(rows))) for rows in (order[i:i + chunk_size] for i in range(0, len(order), chunk_size))]


def scatter_rows(parts: list[tuple[list[int], torch.Tensor]], batch_size: int, response_len: int) -> torch.Tensor:
    """Reassemble per-chunk ``[b, r]`` results into ``[batch_size, response_len]`` (0 where trimmed)."""
    out = torch.zeros(batch_size, response_len, dtype=parts[0][1].dtype)
    for rows, values in parts:
        out[rows, : values.shape[1]] = values
    return out
