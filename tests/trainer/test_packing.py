"""Micro-batches packed by rows and tokens keep every real token and the exact loss sum; their metrics
are reduced once."""

from __future__ import annotations

import attrs
import torch

from skyrl_core.algorithms.reductions import reduction_weights
from skyrl_core.rollout import TrainingSample, build_training_batch
from skyrl_core.backends.packing import combine_micro_metrics, padded_tokens, plan_micro_batches, row_lengths, scatter_rows, trim

PAD = 99


def _batch():
    shapes = [(3, 5), (1, 2), (4, 0), (2, 7), (3, 1)]  # (prompt, response) lengths
    samples = [
        TrainingSample(prompt_ids=tuple(range(10 * i, 10 * i + p)), response_ids=tuple(range(50 + i, 50 + i + r)),
                       loss_mask=(1.0,) * r, logprobs=tuple(-0.1 * (k + 1) for k in range(r)), reward=float(i),
                       group_id=f"g{i % 2}", trajectory_id=f"t{i}", is_last_step=True)
        for i, (p, r) in enumerate(shapes)
    ]
    return samples, build_training_batch(samples, PAD)


def length_sorted_chunks(batch, rows, tokens=None):
    return [(idx, trim(batch.select(idx))) for idx in plan_micro_batches(batch, max_rows=rows, max_tokens=tokens)]


def _real_tokens(batch, row):
    return batch.input_ids[row][batch.attention_mask[row].bool()].tolist()


def test_trim_drops_only_all_padding_columns() -> None:
    _, batch = _batch()
    sub = trim(batch.select([1, 4]))  # prompts of 1 and 3 tokens, responses of 2 and 1
    assert sub.input_ids.shape == (2, 3 + 2) and sub.loss_mask.shape == (2, 2)
    for i, row in enumerate([1, 4]):
        assert _real_tokens(sub, i) == _real_tokens(batch, row)
        assert sub.rollout_logprobs[i].tolist() == batch.rollout_logprobs[row, :2].tolist()
    empty = trim(batch.select([2]))  # a zero-length response keeps one (masked) column
    assert empty.response_len == 1 and empty.loss_mask.sum() == 0


def test_chunks_cover_every_row_once_sorted_by_length() -> None:
    samples, batch = _batch()
    chunks = length_sorted_chunks(batch, 2)
    rows = [r for idx, _ in chunks for r in idx]
    assert sorted(rows) == list(range(len(samples)))
    assert rows == [2, 4, 1, 0, 3]  # by response length, then prompt length
    for idx, chunk in chunks:
        for i, row in enumerate(idx):
            assert _real_tokens(chunk, i) == _real_tokens(batch, row)
            assert chunk.group_ids[i] == batch.group_ids[row]
    # negative control: the full-width batch is wider than any trimmed chunk but the last
    assert max(c.input_ids.shape[1] for _, c in chunks[:-1]) < batch.input_ids.shape[1]


def test_token_weights_sliced_before_chunking_sum_to_the_whole() -> None:
    _, batch = _batch()
    weights = reduction_weights(batch.loss_mask, "sequence_mean")
    per_token = torch.randn(batch.loss_mask.shape, generator=torch.Generator().manual_seed(0)) * batch.loss_mask
    whole = float((per_token * weights).sum())
    batch = attrs.evolve(batch, token_weights=weights, values=per_token)
    chunks = length_sorted_chunks(batch, 2)
    parts = sum(float((c.values * c.token_weights).sum()) for _, c in chunks)
    assert abs(parts - whole) < 1e-6
    # negative control: weights recomputed per chunk would not add up to the whole
    local = sum(float((c.values * reduction_weights(c.loss_mask, "sequence_mean")).sum()) for _, c in chunks)
    assert abs(local - whole) > 1e-3


def test_scatter_rows_restores_batch_order() -> None:
    _, batch = _batch()
    parts = [(idx, chunk.rollout_logprobs) for idx, chunk in length_sorted_chunks(batch, 2)]
    assert torch.equal(scatter_rows(parts, len(batch), batch.response_len), batch.rollout_logprobs)


def test_token_budget_packs_short_rows_together_and_splits_none() -> None:
    _, batch = _batch()  # padded lengths by sorted row: 2:(4,0) 4:(3,1) 1:(1,2) 0:(3,5) 3:(2,7)
    plan = plan_micro_batches(batch, max_rows=16, max_tokens=12)
    assert plan == [[2, 4], [1], [0], [3]]
    assert sorted(r for rows in plan for r in rows) == list(range(5))
    assert all(padded_tokens(batch, rows) <= 12 for rows in plan[:-1])
    # a row longer than the budget is a micro-batch of its own, never split
    alone = plan_micro_batches(batch, max_rows=16, max_tokens=2)
    assert alone == [[2], [4], [1], [0], [3]]
    assert trim(batch.select([3])).input_ids.shape[1] == 2 + 7
    # no token budget: rows only (negative control for the budget above)
    assert plan_micro_batches(batch, max_rows=16) == [[2, 4, 1, 0, 3]]


def test_micro_metrics_are_reduced_once_by_rule() -> None:
    records = [({"loss": 1.0, "ratio_max": 2.0, "ratio_min": 0.5, "kl": 0.1}, 3.0),
               ({"loss": 0.5, "ratio_max": 1.5, "ratio_min": 0.2, "kl": 0.4}, 1.0)]
    out = combine_micro_metrics(records)
    assert out == {"loss": 1.5, "ratio_max": 2.0, "ratio_min": 0.2, "kl": (0.1 * 3 + 0.4) / 4}
    assert combine_micro_metrics([({"kl": 1.0}, 0.0), ({"kl": 3.0}, 0.0)]) == {"kl": 2.0}


def _grouped(prompt_lens, responses_per_prompt):
    """Rows of prompts of ``prompt_lens`` tokens, ``responses_per_prompt[p]`` response lengths each,
    the prompts' rows interleaved (as a batch of several groups comes)."""
    from skyrl_core.testing.backend_contract import make_batch

    rows = [(p, n) for p, lengths in enumerate(responses_per_prompt) for n in lengths]
    rows = rows[::2] + rows[1::2]
    prompts = [list(range(1 + 10 * p, 1 + 10 * p + prompt_lens[p])) for p, _ in rows]
    return make_batch(prompts, [[7] * n for _, n in rows]), [p for p, _ in rows]


def test_shared_prompt_plans_keep_a_prompts_rows_together_within_both_caps() -> None:
    batch, prompt_of = _grouped((4, 6, 3), ((2, 5, 1, 3), (4, 4), (1, 2, 2, 6, 3)))
    plan = plan_micro_batches(batch, max_rows=4, max_tokens=40, prompt_pair_cost=1e6)
    assert sorted(r for rows in plan for r in rows) == list(range(len(batch)))
    _, response_lens = row_lengths(batch)
    for rows in plan:
        assert len(rows) <= 4
        units = {}
        for r in rows:
            units.setdefault(prompt_of[r], []).append(r)
        packed = [(4, 6, 3)[p] + sum(response_lens[r] for r in group) for p, group in units.items()]
        assert len(units) * max(packed) <= 40
    # the five rows of prompt 2 exceed 4 rows: two parts; prompts 0 and 1 stay whole
    parts = [{prompt_of[r] for r in rows} for rows in plan]
    assert sum(2 in p for p in parts) == 2 and sum(0 in p for p in parts) == 1 and sum(1 in p for p in parts) == 1
    # negative control: the row plan sorts by length and splits every prompt's rows
    row_plan = plan_micro_batches(batch, max_rows=4, max_tokens=40)
    assert sum(0 in {prompt_of[r] for r in rows} for rows in row_plan) > 1


def test_a_prompt_group_cheaper_as_rows_is_planned_as_rows() -> None:
    batch, _ = _grouped((2,), ((30, 30, 30),))  # long responses behind a short prompt
    assert plan_micro_batches(batch, max_rows=2, prompt_pair_cost=100.0) == plan_micro_batches(batch, max_rows=2)


def test_a_prompt_group_longer_than_the_token_budget_is_cut_but_never_a_row() -> None:
    batch, _ = _grouped((5,), ((6, 6, 6, 6),))
    plan = plan_micro_batches(batch, max_rows=8, max_tokens=17, prompt_pair_cost=1e6)
    assert [len(rows) for rows in plan] == [2, 2]  # 5 + 6 + 6 = 17 fits, a third response would not
    alone = plan_micro_batches(batch, max_rows=8, max_tokens=3, prompt_pair_cost=1e6)
    assert [len(rows) for rows in alone] == [1, 1, 1, 1]
