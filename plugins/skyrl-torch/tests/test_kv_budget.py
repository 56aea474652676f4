"""skyrl-torch's KV cache within ``kv_cache_memory_bytes``: the bytes it computes from the model's
config, admission within the budget (same tokens, the cache never larger), the refusal of a request
that cannot fit alone, and prefill forwards of bounded size."""

from __future__ import annotations

import itertools

import pytest
import torch

import skyrl_torch.engine as engine_module
from skyrl_core.config.schema import ModelConfig
from skyrl_core.models import load_causal_lm
from skyrl_core.trainer.memory_estimate import machine_memory_bytes
from skyrl_core.testing.engine_contract import (
    TINY_LLAMA,
    TINY_QWEN3,
    TINY_QWEN3_MOE,
    TINY_QWEN3_NEXT,
    request,
    worst_logprob_error,
)
from skyrl_torch.engine import TorchEngine
from skyrl_torch.kv_cache import slot_capacity
from skyrl_torch.options import TorchEngineOptions
from torch_engine_helpers import prompt, record_forwards

FAMILIES = {"qwen3": TINY_QWEN3, "llama": TINY_LLAMA, "qwen3-moe": TINY_QWEN3_MOE, "qwen3-next": TINY_QWEN3_NEXT}
ATOL = 1e-5


def model(family: str, dtype: str = "float32") -> ModelConfig:
    return ModelConfig(config=dict(FAMILIES[family]), dtype=dtype)


def record_cache_bytes(eng: TorchEngine) -> list[tuple[int, int]]:
    """Patch ``eng`` to record, around every scheduler iteration, the bytes of its cache's shape (as
    allocated when the iteration starts) and its ``nbytes`` (its layers allocate at first write)."""
    seen: list[tuple[int, int]] = []
    original = eng._iterate

    def recording(admitted):
        cache = eng._cache
        shape_bytes = eng.kv_budget.cache_bytes(cache.num_slots, cache.capacity)
        original(admitted)
        seen.append((shape_bytes, cache.nbytes))

    eng._iterate = recording
    return seen


def record_bytes_held_while_resizing(eng: TorchEngine) -> list[int]:
    """Patch ``eng`` to record, at every tensor its cache's resize allocates, the bytes the old cache
    still holds plus those allocated for the new one so far (the resize's memory at that moment)."""
    held: list[int] = []
    original = eng._resize_cache

    def resizing(num_slots: int, capacity: int) -> None:
        old, allocated, real_zeros = eng._cache, [0], torch.zeros

        def zeros(*args, **kwargs):
            t = real_zeros(*args, **kwargs)
            allocated[0] += t.numel() * t.element_size()
            held.append(old.nbytes + allocated[0])
            return t

        torch.zeros = zeros
        try:
            original(num_slots, capacity)
        finally:
            torch.zeros = real_zeros

    eng._resize_cache = resizing
    return held


def record_admissions(eng: TorchEngine) -> list[str]:
    """Patch ``eng`` to record the request id of every group it prefills, in admission order (a
    request whose samples are admitted in several parts appears once per part)."""
    admitted: list[str] = []
    original = eng._prefill

    def recording(groups, cache):
        admitted.extend(g[0].request.request_id for g in groups)
        return original(groups, cache)

    eng._prefill = recording
    return admitted


# --- the bytes of a slot ---------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("family", FAMILIES)
def test_cache_bytes_from_the_config_equal_the_cache_nbytes(family, dtype):
    """Per position (every attention layer's keys and values) and per slot (Qwen3-Next's conv and
    recurrent state), the capacity + 1 scratch column: the shape's bytes are the allocated bytes."""
    config = model(family, dtype)
    eng = TorchEngine(config, TorchEngineOptions(max_num_seqs=4), seed=0)
    eng.generate([request(prompt(5), "a", n=3, seed=1, max_tokens=70)])
    cache = eng._cache
    assert (cache.num_slots, cache.capacity) == (3, 128)
    assert eng.kv_budget.cache_bytes(cache.num_slots, cache.capacity) == cache.nbytes
    assert (eng.kv_budget.per_slot > 0) == (family == "qwen3-next")
    # what a server asks before any engine exists: the same, from the config alone
    assert TorchEngine.kv_budget_of(config, TorchEngineOptions(max_num_seqs=4)) == eng.kv_budget


def test_the_default_budget_is_a_quarter_of_physical_memory():
    eng = TorchEngine(model("qwen3"), TorchEngineOptions(), seed=0)
    assert eng.kv_budget.limit == machine_memory_bytes() // 4
    assert TorchEngine(model("qwen3"), TorchEngineOptions(kv_cache_memory_bytes=12345), seed=0).kv_budget.limit == 12345


# --- admission within the budget ---------------------------------------------------------------------


def mixed_requests() -> list:
    """Short requests (64-position slots), then long ones (192-position slots), then short ones."""
    short = [request(prompt(3 + i, i), f"s{i}", n=2, seed=i, max_tokens=12 + 3 * i) for i in range(5)]
    long = [request(prompt(30 + i, 50 + i), f"l{i}", n=2, seed=50 + i, max_tokens=140) for i in range(2)]
    later = [request(prompt(4, 90 + i), f"t{i}", seed=90 + i, max_tokens=20) for i in range(4)]
    return short + long + later


@pytest.mark.parametrize("family", ["qwen3", "qwen3-next"])
def test_samples_wait_for_room_in_the_budget_and_come_out_the_same(family):
    """A budget with room for two slots of the longest request: the cache never takes more (the
    shape as allocated, and its bytes), samples wait and join as others finish, and every sample's
    tokens are those of an unlimited run (logprobs to float noise: without IsoExec, GEMMs round per
    batch shape, and the batches differ)."""
    config = model(family)
    requests = mixed_requests()
    unlimited = TorchEngine(config, TorchEngineOptions(), seed=0)
    expected = unlimited.generate(requests)
    longest = max(len(r.prompt_token_ids) + r.sampling.max_tokens for r in requests)
    budget = unlimited.kv_budget.cache_bytes(2, slot_capacity(longest))
    # negative control: without the budget, the cache holds every sample at the longest capacity
    assert unlimited._cache.nbytes > 3 * budget

    bounded = TorchEngine(config, TorchEngineOptions(kv_cache_memory_bytes=budget), seed=0)
    cache_bytes = record_cache_bytes(bounded)
    shapes = record_forwards(bounded)
    admitted = record_admissions(bounded)
    out = bounded.generate(requests)

    assert max(max(pair) for pair in cache_bytes) <= budget
    assert bounded._cache.nbytes <= budget
    assert max(rows for rows, tokens in shapes if tokens == 1) <= 5  # 64-position slots: 5 fit
    assert [r for r, _ in itertools.groupby(admitted)] == [r.request_id for r in requests]  # in arrival order
    for got, want in zip(out, expected):
        assert [s.token_ids for s in got] == [s.token_ids for s in want]
        for s, w in zip(got, want):
            assert max(abs(a - b) for a, b in zip(s.logprobs, w.logprobs)) <= ATOL
    assert worst_logprob_error(load_causal_lm(config, seed=0), out) <= ATOL


@pytest.mark.parametrize("family", ["qwen3", "qwen3-next"])
def test_the_cache_is_rebuilt_smaller_and_samples_in_flight_move_down_with_their_keys_and_values(family):
    """Room for 6 slots of 64 positions or 2 of 192: five short samples fill slots 0-4, a long
    request waits until only the last short one is in flight (slot 4); the cache is then rebuilt
    with 2 slots of 192 positions, that sample first moved down to slot 0 (keys, values and, for
    Qwen3-Next, its conv and recurrent state). It continues to the same tokens as in an unlimited run."""
    config = model(family)
    shorts = [request(prompt(4, i), f"s{i}", seed=i, max_tokens=5 + 5 * i) for i in range(5)]
    requests = [*shorts, request(prompt(30, 9), "long", seed=9, max_tokens=150),
                *[request(prompt(4, 20 + i), f"t{i}", seed=20 + i, max_tokens=10) for i in range(3)]]
    unlimited = TorchEngine(config, TorchEngineOptions(), seed=0)
    expected = unlimited.generate(requests)
    budget = unlimited.kv_budget.cache_bytes(6, 64)
    assert unlimited.kv_budget.cache_bytes(2, 192) <= budget < unlimited.kv_budget.cache_bytes(3, 192)

    eng = TorchEngine(config, TorchEngineOptions(kv_cache_memory_bytes=budget), seed=0)
    cache_bytes = record_cache_bytes(eng)
    resizes: list[tuple[list[int], tuple[int, int], list[int]]] = []  # active slots before, shape, after
    original = eng._resize_cache

    def recording(num_slots: int, capacity: int) -> None:
        before = sorted(eng._active)
        original(num_slots, capacity)
        resizes.append((before, (num_slots, capacity), sorted(eng._active)))

    eng._resize_cache = recording
    held_during_resize = record_bytes_held_while_resizing(eng)
    out = eng.generate(requests)
    assert max(max(pair) for pair in cache_bytes) <= budget
    assert ([4], (2, 192), [0]) in resizes, resizes
    # While the cache is rebuilt, the old one gives up each layer as it is copied: the bytes held at
    # once stay within the budget plus one layer (the old code held both caches: about twice it).
    layer_bytes = max(eng.kv_budget.cache_bytes(6, 64), eng.kv_budget.cache_bytes(2, 192)) // eng.model.config.get_text_config().num_hidden_layers
    assert held_during_resize and max(held_during_resize) <= budget + layer_bytes, (held_during_resize, budget)
    assert [g[0].token_ids for g in out] == [g[0].token_ids for g in expected]
    assert worst_logprob_error(load_causal_lm(config, seed=0), out) <= ATOL


def test_a_long_request_beside_short_ones_waits_its_turn_and_is_not_overtaken():
    """One long sample among short ones under a budget with room for it alone (or for 4 short
    ones): it waits until the short ones before it finish, the ones after it wait for it (no
    skipping ahead: FIFO), all complete, and the cache stays within the budget."""
    config = model("qwen3")
    before = [request(prompt(4, i), f"a{i}", seed=i, max_tokens=8) for i in range(6)]
    long = request(prompt(40, 7), "long", seed=7, max_tokens=200)
    after = [request(prompt(4, 20 + i), f"b{i}", seed=20 + i, max_tokens=8) for i in range(6)]
    requests = [*before, long, *after]
    unlimited = TorchEngine(config, TorchEngineOptions(), seed=0)
    budget = unlimited.kv_budget.cache_bytes(4, 64)
    assert unlimited.kv_budget.cache_bytes(1, slot_capacity(240)) <= budget < unlimited.kv_budget.cache_bytes(2, 256)
    expected = unlimited.generate(requests)
    assert unlimited._cache.nbytes > budget  # negative control

    eng = TorchEngine(config, TorchEngineOptions(kv_cache_memory_bytes=budget), seed=0)
    cache_bytes = record_cache_bytes(eng)
    admitted = record_admissions(eng)
    shapes = record_forwards(eng)
    out = eng.generate(requests)
    assert max(max(pair) for pair in cache_bytes) <= budget
    assert [r for r, _ in itertools.groupby(admitted)] == [r.request_id for r in requests]
    assert max(rows for rows, tokens in shapes if tokens == 1) <= 4
    assert len(out[6][0].token_ids) == 200 or out[6][0].stop_reason == "stop"
    assert [g[0].token_ids for g in out] == [g[0].token_ids for g in expected]


def test_with_room_for_everything_the_budget_changes_no_forward_and_no_bit():
    """A budget of exactly the unlimited run's cache: the same cache, the same forwards, the same
    bits (so the rest of this suite, under the default budget, tests the unbounded scheduler)."""
    config = model("qwen3")
    requests = mixed_requests()
    unlimited = TorchEngine(config, TorchEngineOptions(max_num_seqs=6), seed=0)
    unlimited_shapes = record_forwards(unlimited)
    expected = unlimited.generate(requests)
    budget = unlimited._cache.nbytes
    eng = TorchEngine(config, TorchEngineOptions(max_num_seqs=6, kv_cache_memory_bytes=budget), seed=0)
    shapes = record_forwards(eng)
    out = eng.generate(requests)
    assert shapes == unlimited_shapes
    assert eng._cache.nbytes == budget
    assert [[s.logprobs for s in g] for g in out] == [[s.logprobs for s in g] for g in expected]
    assert [[s.token_ids for s in g] for g in out] == [[s.token_ids for s in g] for g in expected]


# --- refusal -------------------------------------------------------------------------------------------


def test_a_request_that_cannot_fit_alone_is_refused_and_the_engine_serves_on():
    config = model("qwen3")
    eng = TorchEngine(config, TorchEngineOptions(kv_cache_memory_bytes=200_000), seed=0)
    needed = eng.kv_budget.cache_bytes(1, 256)  # 5 + 200 tokens: a 256-position slot
    assert needed > 200_000 >= eng.kv_budget.cache_bytes(1, 192)
    fits = request(prompt(5), "fits", n=2, seed=1, max_tokens=150)
    too_long = request(prompt(5), "too-long", seed=1, max_tokens=200)
    message = (rf"request 'too-long': one sample of 205 tokens .* needs {needed} bytes of KV cache, "
               r"more than kv_cache_memory_bytes \(200000\)")
    with pytest.raises(ValueError, match=message):
        eng.generate([too_long])
    with pytest.raises(ValueError, match=message):  # refused before anything is queued: nothing else runs
        eng.generate([fits, too_long])
    assert eng.in_flight() == {} and eng._cache is None
    (group,) = eng.generate([fits])
    assert [len(s.token_ids) for s in group] == [150, 150] or any(s.stop_reason == "stop" for s in group)
    assert eng._cache.nbytes <= 200_000


def test_the_option_is_validated():
    with pytest.raises(ValueError, match="kv_cache_memory_bytes must be a positive integer or null"):
        TorchEngineOptions(kv_cache_memory_bytes=0)


# --- prefill forwards ----------------------------------------------------------------------------------


@pytest.mark.parametrize("shared_prefix", [0, 16], ids=["whole-prompts", "shared-prefix"])
def test_prefill_forwards_are_cut_at_the_token_bound(monkeypatch, shared_prefix):
    """Prompts admitted together go in forwards of at most PREFILL_TOKENS padded tokens (a longer
    prompt alone), with a prefix common to them all still prefilled once and shared across those
    forwards: the same tokens as one forward of them all."""
    config = model("qwen3")
    common = prompt(20, 200)
    requests = [request(common + prompt(k, k), f"p{k}", n=2, seed=k, max_tokens=6) for k in (3, 25, 4, 60, 1, 9)]
    whole = TorchEngine(config, TorchEngineOptions(shared_prefix_min_tokens=shared_prefix), seed=0)
    whole_shapes = record_forwards(whole)
    expected = whole.generate(requests)
    monkeypatch.setattr(engine_module, "PREFILL_TOKENS", 64)
    eng = TorchEngine(config, TorchEngineOptions(shared_prefix_min_tokens=shared_prefix), seed=0)
    shapes = record_forwards(eng)
    out = eng.generate(requests)
    prefills = [s for s in shapes if s[1] > 1]
    start = 20 if shared_prefix else 0
    widths = [len(r.prompt_token_ids) - start for r in requests]
    if shared_prefix:
        assert prefills[0] == whole_shapes[0] == (1, 20)  # the common prefix, once
        prefills = prefills[1:]
    assert whole_shapes[1 if shared_prefix else 0] == (6, max(widths))  # without the bound: one forward
    assert sum(rows for rows, _ in prefills) == 6 and len(prefills) > 2
    assert all(rows * width <= 64 or rows == 1 for rows, width in prefills)
    assert [[s.token_ids for s in g] for g in out] == [[s.token_ids for s in g] for g in expected]
    assert worst_logprob_error(load_causal_lm(config, seed=0), out) <= ATOL
