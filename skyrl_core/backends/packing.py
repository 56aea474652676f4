"""Micro-batches a backend forms from a mini-batch, and the one place their metrics are reduced.

A mini-batch is padded to its longest prompt and longest response; most rows are shorter. Rows are
sorted by length and packed greedily into micro-batches under two caps: at most ``max_rows`` rows
and at most ``max_tokens`` padded positions (rows x the micro-batch's own longest prompt + longest
response, which is what the forward and backward passes hold in memory). No row is ever split: a
row longer than the token budget is a micro-batch of its own. Each micro-batch is trimmed of the
columns that are padding in all its rows. Token weights are computed on the whole mini-batch before
cutting, so the micro-batch losses still sum exactly to the mini-batch's loss.
"""

from __future__ import annotations

from typing import Callable, Sequence

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
    if batch.position_ids is not None:
        changes["position_ids"] = batch.position_ids[:, first:P + keep]
    for name in _RESPONSE_FIELDS:
        value = getattr(batch, name)
        if value is not None:
            changes[name] = value[:, :keep]
    return attrs.evolve(batch, **changes)


def row_lengths(batch: TrainingBatch) -> tuple[list[int], list[int]]:
    """Real prompt and response lengths of every row."""
    P = batch.prompt_len
    return batch.attention_mask[:, :P].sum(-1).tolist(), batch.attention_mask[:, P:].sum(-1).tolist()


def plan_micro_batches(batch: TrainingBatch, *, max_rows: int, max_tokens: int | None = None,
                       prompt_pair_cost: float | None = None) -> list[list[int]]:
    """Row indices of each micro-batch of ``batch``: rows sorted by (response, prompt) length (a stable
    order, so the plan depends only on the batch), packed while the micro-batch has at most
    ``max_rows`` rows and, when ``max_tokens`` is set, at most that many padded positions.

    ``prompt_pair_cost`` (the model's ``token_cost_in_pairs``; None: rows apart): where rows share a
    prompt and one sequence costs less (``skyrl_core.ops.shared_prompts.sharing_groups``), the rows
    of one prompt stay together (up to ``max_rows`` a micro-batch), to be computed as one sequence;
    positions count the packed form."""
    if max_rows < 1 or (max_tokens is not None and max_tokens < 1):
        raise ValueError(f"micro-batch caps must be >= 1; got max_rows={max_rows!r}, max_tokens={max_tokens!r}")
    if prompt_pair_cost is not None and max_rows > 1:
        from skyrl_core.ops.shared_prompts import sharing_groups

        groups = sharing_groups(batch.input_ids, batch.attention_mask, batch.prompt_len, prompt_pair_cost)
        if any(len(group) > 1 for group in groups):  # (else nothing is shared: the rows' plan)
            return _plan_prompt_groups(batch, groups, max_rows, max_tokens)
    prompt_lens, response_lens = row_lengths(batch)
    order = sorted(range(len(batch)), key=lambda i: (response_lens[i], prompt_lens[i]))
    plan: list[list[int]] = []
    current: list[int] = []
    longest_prompt = longest_response = 0
    for i in order:
        p, r = max(longest_prompt, prompt_lens[i]), max(longest_response, response_lens[i])
        fits = len(current) < max_rows and (max_tokens is None or (len(current) + 1) * (p + max(r, 1)) <= max_tokens)
        if current and not fits:
            plan.append(current)
            current, p, r = [], prompt_lens[i], response_lens[i]
        current.append(i)
        longest_prompt, longest_response = p, r
    if current:
        plan.append(current)
    return plan


def _plan_prompt_groups(batch: TrainingBatch, groups: list[list[int]], max_rows: int, max_tokens: int | None) -> list[list[int]]:
    """Micro-batches of whole prompt groups (``plan_group_passes``): a part of a group holds at most
    ``max_rows`` rows and ``max_tokens`` packed positions, and so does a micro-batch (its parts x
    the longest part's packed length)."""
    prompt_lens, response_lens = row_lengths(batch)

    def within(rows: int, longest: int, count: int = 1) -> bool:
        return rows <= max_rows and (max_tokens is None or count * longest <= max_tokens)

    return plan_group_passes(
        [(group, prompt_lens[group[0]]) for group in groups], [max(1, n) for n in response_lens],  # (a row holds a position)
        part_fits=lambda count, length: within(count, length),
        pass_fits=lambda parts: within(sum(len(rows) for rows, _ in parts), max(n for _, n in parts), len(parts)),
    )


def plan_group_passes(
    groups: Sequence[tuple[Sequence[int], int]],
    rest_lens: Sequence[int],
    *,
    part_fits: Callable[[int, int], bool],
    pass_fits: Callable[[list[tuple[list[int], int]]], bool],
) -> list[list[int]]:
    """Passes of data that share a prefix, each group computed as one sequence: its prefix, then
    every member's rest. ``groups`` are ``(members, prefix length)``; ``rest_lens[i]`` is datum
    ``i``'s length after its group's prefix.

    A group's members, shortest rest first, are cut into parts: a part takes the next member while
    ``part_fits(count, packed length)`` (``count``: its members with the next one; a part has one at
    least; the packed length is the prefix plus the rests). Parts in order of packed length (then of their
    first member: the plan depends only on the lengths) join a pass while ``pass_fits(parts)``
    (each part a ``(members, packed length)``; a pass has one part at least), so a pass pads its
    sequences to a length close to theirs. Returns each pass's data."""
    parts: list[tuple[list[int], int]] = []
    for members, prefix in groups:
        part: list[int] = []
        length = prefix  # the part's packed length
        for i in sorted(members, key=lambda i: rest_lens[i]):
            if part and not part_fits(len(part) + 1, length + rest_lens[i]):
                parts.append((part, length))
                part, length = [], prefix
            part.append(i)
            length += rest_lens[i]
        parts.append((part, length))
    parts.sort(key=lambda p: (p[1], p[0][0]))
    plan: list[list[int]] = []
    current: list[tuple[list[int], int]] = []
    for part in parts:
        if current and not pass_fits(current + [part]):
            plan.append([i for members, _ in current for i in members])
            current = []
        current.append(part)
    if current:
        plan.append([i for members, _ in current for i in members])
    return plan


def padded_tokens(batch: TrainingBatch, rows: Sequence[int]) -> int:
    """Positions a micro-batch of ``rows`` holds once trimmed: rows x (longest prompt + longest response)."""
    prompt_lens, response_lens = row_lengths(batch.select(list(rows)))
    return len(rows) * (max(prompt_lens) + max(max(response_lens), 1))


def scatter_rows(parts: list[tuple[list[int], torch.Tensor]], batch_size: int, response_len: int) -> torch.Tensor:
    """Reassemble per-micro-batch ``[b, r]`` results into ``[batch_size, response_len]`` (0 where trimmed)."""
    out = torch.zeros(batch_size, response_len, dtype=parts[0][1].dtype if parts else torch.float32)
    for rows, values in parts:
        out[rows, : values.shape[1]] = values
    return out


def combine_micro_metrics(records: Sequence[tuple[dict[str, float], float]]) -> dict[str, float]:
    """One mini-batch's metrics from its micro-batches' ``(metrics, trained tokens)``: ``loss`` adds up
    (micro-batch losses are shares of the mini-batch's), ``*_max``/``*_min`` are the extremes, the
    rest is averaged weighted by trained tokens (plainly when no micro-batch trained a token)."""
    out: dict[str, float] = {}
    for key in dict.fromkeys(k for metrics, _ in records for k in metrics):
        pairs = [(metrics[key], tokens) for metrics, tokens in records if key in metrics]
        values = [v for v, _ in pairs]
        if key == "loss":
            out[key] = sum(values)
        elif key.endswith("_max"):
            out[key] = max(values)
        elif key.endswith("_min"):
            out[key] = min(values)
        else:
            total = sum(n for _, n in pairs)
            out[key] = sum(v * n for v, n in pairs) / total if total else sum(values) / len(values)
    return out
