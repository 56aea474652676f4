"""skyrl-torch on a hybrid decoder (Qwen3-Next: GatedDeltaNet linear-attention layers + attention):
the per-slot conv/recurrent state through prefill sharing, continuous batching and compaction.
(The engine contract suite also runs on this model: test_contract.py.)"""

from __future__ import annotations

import attrs
import pytest
import torch

from skyrl_core.config.schema import ModelConfig
from skyrl_core.models import load_causal_lm
from skyrl_core.testing.engine_contract import TINY_QWEN3, TINY_QWEN3_NEXT, full_forward_logprobs, request
from skyrl_torch.engine import TorchEngine
from skyrl_torch.kv_cache import SlotKVCache
from skyrl_torch.options import TorchEngineOptions
from torch_engine_helpers import prompt, record_forwards

MODEL = ModelConfig(config=dict(TINY_QWEN3_NEXT))
ATOL = 1e-5


@pytest.fixture(scope="module")
def reference():
    return load_causal_lm(MODEL, seed=0)


def engine(**options) -> TorchEngine:
    return TorchEngine(MODEL, TorchEngineOptions(**options), seed=0)


def worst_error(reference, samples) -> float:
    """max |engine logprob - log-softmax of one full forward over prompt + tokens|."""
    return max(
        float((torch.tensor(s.logprobs) - full_forward_logprobs(reference, s.prompt_token_ids, s.token_ids)).abs().max())
        for s in samples
    )


@pytest.fixture
def without_state_copies(monkeypatch):
    """Negative control: ``copy_prefix`` copies keys/values but not the linear-attention state."""
    original = SlotKVCache.copy_prefix

    def keys_values_only(self, src_slot, dst_slots, length):
        conv, recurrent = self.conv, self.recurrent
        self.conv, self.recurrent = {}, {}
        try:
            original(self, src_slot, dst_slots, length)
        finally:
            self.conv, self.recurrent = conv, recurrent

    monkeypatch.setattr(SlotKVCache, "copy_prefix", keys_values_only)


def test_the_cache_holds_a_state_per_slot_for_linear_layers_only():
    eng = engine(max_num_seqs=3)
    assert eng.linear_layers == (0, 2)
    eng.generate([request(prompt(5), "x", n=3, max_tokens=3, seed=0)])
    cache = eng._cache
    assert sorted(cache.conv) == sorted(cache.recurrent) == [0, 2]
    assert cache.keys[1] is not None and cache.keys[0] is None and cache.keys[2] is None
    assert tuple(cache.conv[0].shape) == (3, 2 * 2 * 16 + 4 * 16, 4)  # slots, q+k+v channels, conv width
    assert tuple(cache.recurrent[0].shape) == (3, 4, 16, 16) and cache.recurrent[0].dtype == torch.float32


def test_n_samples_share_one_prefill_and_each_gets_the_state(reference):
    eng = engine()
    shapes = record_forwards(eng)
    out = eng.generate([request(prompt(9), "n", n=4, seed=1, max_tokens=8)])[0]
    assert shapes[0] == (1, 9)  # the prompt is computed once ...
    assert shapes[1] == (4, 1)  # ... and the 4 samples decode together from copies of its state
    assert len({s.token_ids for s in out}) > 1
    assert worst_error(reference, out) <= ATOL


def test_negative_control_samples_without_the_copied_state_are_wrong(reference, without_state_copies):
    out = engine().generate([request(prompt(9), "n", n=4, seed=1, max_tokens=8)])[0]
    assert worst_error(reference, out[:1]) <= ATOL  # the sample that prefilled keeps its own state
    assert worst_error(reference, out[1:]) > 1e-2


def test_more_samples_than_slots_with_mixed_prompt_lengths(reference):
    """Left-padded prefills (prompts of 1..23 tokens, some shorter than the conv width), waiting
    samples taking freed slots (whose old state must not leak), same tokens as each request alone."""
    lengths = (1, 23, 3, 12, 2)
    requests = [request(prompt(n, n), f"r{n}", n=2, seed=n, max_tokens=4 + 3 * i) for i, n in enumerate(lengths)]
    small = engine(max_num_seqs=3)
    shapes = record_forwards(small)
    batched = small.generate(requests)
    assert max(rows for rows, tokens in shapes if tokens == 1) <= 3
    assert any(rows > 1 and tokens > 1 for rows, tokens in shapes)  # a left-padded multi-row prefill
    alone = engine(max_num_seqs=16)
    for req, group in zip(requests, batched):
        assert [s.token_ids for s in group] == [s.token_ids for s in alone.generate([req])[0]]
    assert worst_error(reference, [s for g in batched for s in g]) <= ATOL


@pytest.mark.parametrize("copy_state", [True, False], ids=["state-moves", "negative-control"])
def test_compaction_moves_the_state_with_the_sample(reference, copy_state, request):
    """Once nothing waits, in-flight samples move down into freed slots, state included."""
    if not copy_state:
        request.getfixturevalue("without_state_copies")
    lengths = (2, 12, 3, 12, 5)
    requests = [request_(prompt(4, i), f"r{i}", seed=i, max_tokens=m) for i, m in enumerate(lengths)]
    eng = engine(max_num_seqs=8)
    shapes = record_forwards(eng)
    out = eng.generate(requests)
    decode_rows = [rows for rows, tokens in shapes if tokens == 1]
    assert decode_rows == [sum(1 for m in lengths if m > step) for step in range(1, max(lengths))]
    # Slot 4 (r4) moves into slot 0 when r0 ends; r3 moves from slot 3 to 2 when r2 ends, then to 0.
    moved = [out[3][0], out[4][0]]
    if copy_state:
        assert worst_error(reference, [g[0] for g in out]) <= ATOL
    else:
        assert worst_error(reference, [g[0] for g in out[:3]]) <= ATOL  # never moved
        assert min(worst_error(reference, [s]) for s in moved) > 1e-2


def test_a_shared_prompt_prefix_is_not_prefilled_apart(reference):
    """A left-padded continuation would run the padding through the recurrent state: hybrid models
    prefill whole prompts, even when a common prefix is long enough to share."""
    shared = prompt(20)
    requests = [request(shared + prompt(k + 1, 100 + k), f"s{k}", seed=k, max_tokens=5) for k in range(3)]
    eng = engine(shared_prefix_min_tokens=16)
    shapes = record_forwards(eng)
    out = eng.generate(requests)
    assert shapes[0] == (3, 23)
    assert worst_error(reference, [g[0] for g in out]) <= ATOL


def test_seeded_runs_repeat_and_stop_tokens_cut_them():
    req = request(prompt(7), "s", n=3, seed=5, max_tokens=12)
    first = engine(max_num_seqs=2).generate([req])[0]
    assert [s.logprobs for s in first] == [s.logprobs for s in engine(max_num_seqs=2).generate([req])[0]]
    # Other slot counts batch the samples otherwise (stock GEMMs round per batch shape): same tokens.
    again = engine(max_num_seqs=8).generate([req])[0]
    assert [s.token_ids for s in first] == [s.token_ids for s in again]
    assert max(abs(a - b) for x, y in zip(first, again) for a, b in zip(x.logprobs, y.logprobs)) <= ATOL
    other = engine().generate([attrs.evolve(req, sampling=attrs.evolve(req.sampling, seed=6))])[0]
    assert [s.token_ids for s in other] != [s.token_ids for s in first]
    stop_id = first[0].token_ids[5]
    cut = first[0].token_ids.index(stop_id) + 1
    stopped = engine().generate([attrs.evolve(req, sampling=attrs.evolve(req.sampling, stop_token_ids=(stop_id,)))])[0]
    assert stopped[0].stop_reason == "stop" and stopped[0].token_ids == first[0].token_ids[:cut]
    for s, free in zip(stopped[1:], first[1:]):  # the other samples stop at their own first stop_id
        n = free.token_ids.index(stop_id) + 1 if stop_id in free.token_ids else len(free.token_ids)
        assert s.token_ids == free.token_ids[:n]


@pytest.mark.parametrize("write_back", [True, False], ids=["written-back", "negative-control"])
def test_rows_in_any_slot_order_read_and_write_their_own_state(reference, write_back, monkeypatch):
    """The cache API on gathered (non-contiguous) rows: one-token steps of slots [2, 0], where
    transformers updates the conv history it read (a gathered copy) in place and the cache writes
    it back. The control drops that write-back."""
    if not write_back:
        original = SlotKVCache.update_recurrent_state

        def forgetting(self, state, layer_idx, *args, **kwargs):
            self.layers[layer_idx].handed_out = None
            return original(self, state, layer_idx, *args, **kwargs)

        monkeypatch.setattr(SlotKVCache, "update_recurrent_state", forgetting)
    eng = engine(max_num_seqs=3)
    cache = eng._ensure_cache(3, 64)
    seqs = [prompt(12, 1), prompt(12, 2)]

    def step(start, stop, fresh):
        tokens = torch.tensor([s[start:stop] for s in seqs])
        positions = torch.arange(start, stop).expand(2, -1)
        with torch.inference_mode():
            logits = eng._forward_rows(cache, torch.tensor([2, 0]), tokens, positions, fresh=fresh)
        return logits.float().log_softmax(-1)

    got = torch.stack([step(0, 5, True)] + [step(t, t + 1, False) for t in range(5, 11)], dim=1)
    with torch.no_grad():
        full = reference(input_ids=torch.tensor(seqs)).logits.float().log_softmax(-1)[:, 4:11]
    error = float((got - full).abs().max())
    assert error <= ATOL if write_back else error > 1e-2


def test_bf16_smoke():
    bf16 = attrs.evolve(MODEL, dtype="bfloat16")
    eng = TorchEngine(bf16, TorchEngineOptions(), seed=0)
    out = eng.generate([request(prompt(5, i), str(i), n=2, seed=i, max_tokens=8) for i in range(3)])
    assert eng._cache.conv[0].dtype == torch.bfloat16 and eng._cache.recurrent[0].dtype == torch.float32
    ref = load_causal_lm(bf16, seed=0)
    for s in (s for g in out for s in g):
        got = torch.tensor(s.logprobs)
        assert torch.isfinite(got).all() and (got <= 0).all()
        assert (got - full_forward_logprobs(ref, s.prompt_token_ids, s.token_ids)).abs().max() < 0.1


def test_other_layer_types_are_refused():
    sliding = ModelConfig(
        config={**TINY_QWEN3, "layer_types": ["sliding_attention", "full_attention"], "use_sliding_window": True, "sliding_window": 8}
    )
    with pytest.raises(NotImplementedError, match="sliding_attention"):
        TorchEngine(sliding, TorchEngineOptions())


request_ = request
