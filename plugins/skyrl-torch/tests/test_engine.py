"""skyrl-torch beyond the shared contract: batching, prefill sharing, implementations, errors, bf16."""

from __future__ import annotations

import subprocess
import sys

import attrs
import pytest
import torch

from skyrl_core.config.schema import ModelConfig
from skyrl_core.models import load_causal_lm
from skyrl_core.testing.engine_contract import TINY_QWEN3, argmax_decode, full_forward_logprobs, request
from skyrl_torch.engine import TorchEngine
from skyrl_torch.options import TorchEngineOptions
from torch_engine_helpers import prompt, record_forwards

MODEL = ModelConfig(config=dict(TINY_QWEN3))
ATOL = 1e-5


@pytest.fixture(scope="module")
def reference():
    return load_causal_lm(MODEL, seed=0)


def engine(**options) -> TorchEngine:
    return TorchEngine(MODEL, TorchEngineOptions(**options), seed=0)


def assert_logprobs_match(reference, samples) -> None:
    for s in samples:
        expected = full_forward_logprobs(reference, s.prompt_token_ids, s.token_ids)
        assert (torch.tensor(s.logprobs) - expected).abs().max() <= ATOL


# --- scheduling ----------------------------------------------------------------------------------


def test_more_samples_than_slots_wait_and_join_with_identical_results(reference):
    requests = [request(prompt(3 + 2 * i, i), f"r{i}", n=2, seed=i, max_tokens=6 + 3 * i) for i in range(5)]
    small = engine(max_num_seqs=3)
    shapes = record_forwards(small)
    batched = small.generate(requests)
    assert small._cache.num_slots == 3
    assert max(rows for rows, tokens in shapes if tokens == 1) <= 3  # never more rows than slots decode
    big = engine(max_num_seqs=64)
    for req, group in zip(requests, batched):
        alone = big.generate([req])[0]
        assert [s.token_ids for s in group] == [s.token_ids for s in alone]
        assert len(group[0].token_ids) == req.sampling.max_tokens or group[0].stop_reason == "stop"
        assert_logprobs_match(reference, group)


def test_finished_samples_leave_and_decode_shrinks_to_the_samples_in_flight(reference):
    """Once nothing waits, samples move down into freed slots: decode rows == samples in flight."""
    lengths = (2, 9, 3, 12, 5)
    requests = [request(prompt(4, i), f"r{i}", seed=i, max_tokens=m) for i, m in enumerate(lengths)]
    eng = engine(max_num_seqs=8)
    shapes = record_forwards(eng)
    out = eng.generate(requests)
    decode_rows = [rows for rows, tokens in shapes if tokens == 1]
    in_flight = [sum(1 for m in lengths if m > step) for step in range(1, max(lengths))]
    assert decode_rows == in_flight
    for req, group in zip(requests, out):
        assert group[0].token_ids == eng.generate([req])[0][0].token_ids
    assert_logprobs_match(reference, [g[0] for g in out])


def test_a_request_with_more_samples_than_slots_is_split():
    req = request(prompt(5), "big", n=5, seed=3, max_tokens=5)
    split = engine(max_num_seqs=2).generate([req])[0]
    whole = engine(max_num_seqs=8).generate([req])[0]
    assert [s.sample_index for s in split] == list(range(5))
    assert [s.token_ids for s in split] == [s.token_ids for s in whole]


def test_prompt_lengths_in_one_batch_do_not_change_results(reference):
    """Rows of very different lengths share prefill and decode forwards (left padding, slot masks)."""
    lengths = (1, 17, 4, 33)
    requests = [request(prompt(n, n), f"p{n}", seed=n, max_tokens=8) for n in lengths]
    eng = engine(shared_prefix_min_tokens=0)
    together = eng.generate(requests)
    for req, group in zip(requests, together):
        alone = eng.generate([req])[0]
        assert group[0].token_ids == alone[0].token_ids
        assert max(abs(a - b) for a, b in zip(group[0].logprobs, alone[0].logprobs)) <= ATOL
    assert_logprobs_match(reference, [g[0] for g in together])


def test_n_samples_share_one_prefill(reference):
    eng = engine()
    shapes = record_forwards(eng)
    out = eng.generate([request(prompt(9), "n", n=4, seed=1, max_tokens=5)])[0]
    assert shapes[0] == (1, 9)  # the prompt is computed once ...
    assert shapes[1] == (4, 1)  # ... and decode steps feed the 4 samples together
    assert all(s[0] <= 4 and s[1] == 1 for s in shapes[1:])
    assert len({s.token_ids for s in out}) > 1
    assert_logprobs_match(reference, out)


def test_a_prefix_common_to_prompts_is_prefilled_once(reference):
    shared = prompt(20)
    prompts = [shared + prompt(k + 1, 100 + k) for k in range(3)]
    requests = [request(p, f"s{i}", seed=i, n=2, max_tokens=6) for i, p in enumerate(prompts)]
    eng = engine(shared_prefix_min_tokens=16)
    shapes = record_forwards(eng)
    out = eng.generate(requests)
    assert shapes[:2] == [(1, 20), (3, 3)]  # the prefix once, then the three suffixes (left-padded)
    plain = engine(shared_prefix_min_tokens=0).generate(requests)
    for a, b in zip(out, plain):
        assert [s.token_ids for s in a] == [s.token_ids for s in b]
    assert_logprobs_match(reference, [s for g in out for s in g])


def test_a_stop_string_spanning_several_tokens():
    eng = engine()
    for seed in range(50):  # find a free run with three printable ASCII characters in a row
        free = eng.generate([request(prompt(6), "s", seed=seed, max_tokens=30)])[0][0]
        spans = [i for i in range(1, len(free.text) - 2) if all(32 < ord(c) < 127 for c in free.text[i : i + 3])]
        if spans:
            break
    stop = free.text[spans[0] : spans[0] + 3]
    stopped = eng.generate([request(prompt(6), "s", seed=seed, max_tokens=30, stop=(stop,))])[0][0]
    assert stopped.stop_reason == "stop"
    assert stopped.text == free.text[: free.text.find(stop)]
    assert eng.tokenizer.decode(stopped.token_ids).endswith(stop)  # one byte per token: ends exactly there
    assert stopped.token_ids == free.token_ids[: len(stopped.token_ids)]


# --- implementations -------------------------------------------------------------------------------


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
def test_transformers_implementation_matches_native(reference, attention):
    requests = [request(prompt(4 + i, i), str(i), seed=i, n=2, max_tokens=8, temperature=0.9) for i in range(3)]
    native = engine()
    modules = engine(implementation="transformers", attention=attention)
    assert native.execution_contract()["implementation"] == "native"
    assert modules.execution_contract()["implementation"] == "transformers"
    a, b = native.generate(requests), modules.generate(requests)
    assert [[s.token_ids for s in g] for g in a] == [[s.token_ids for s in g] for g in b]
    assert_logprobs_match(reference, [s for g in b for s in g])


def test_two_threads_give_the_same_samples_and_the_thread_count_is_restored(reference):
    """With 2 threads the native forward runs element-wise kernels on one thread (decode-sized
    tensors) and matrix products on both; the caller's setting must survive."""
    requests = [request(prompt(5, i), str(i), seed=i, n=2, max_tokens=6) for i in range(3)]
    one = engine().generate(requests)
    torch.set_num_threads(2)  # the autouse fixture restores the previous setting
    two = engine(one_thread_below_macs=0).generate(requests)  # (the tiny model's steps would take one)
    assert torch.get_num_threads() == 2
    assert [[s.token_ids for s in g] for g in one] == [[s.token_ids for s in g] for g in two]
    assert_logprobs_match(reference, [s for g in two for s in g])


def test_uniforms_drawn_ahead_are_the_stream_drawn_one_token_at_a_time(monkeypatch):
    """A sample draws ``UNIFORMS_PER_DRAW`` uniform numbers at a time from its generator; its tokens
    are those of one draw per token, across draw boundaries (45 tokens, draws of 32), and a greedy
    sample beside it draws none."""
    import skyrl_torch.engine

    requests = [request(prompt(4, i), f"r{i}", n=3, seed=7 + i, max_tokens=45, temperature=2.0) for i in range(2)]
    requests.append(request(prompt(4, 9), "greedy", temperature=0.0, max_tokens=45))

    def run() -> tuple[list[list[int]], torch.Tensor]:
        samples = [s for g in engine().generate(requests) for s in g]
        return [s.token_ids for s in samples], torch.tensor([x for s in samples for x in s.logprobs]).view(torch.int32)

    assert skyrl_torch.engine.UNIFORMS_PER_DRAW == 32
    tokens, logprob_bits = run()
    assert max(len(t) for t in tokens) > 32  # past the first draw
    monkeypatch.setattr(skyrl_torch.engine, "UNIFORMS_PER_DRAW", 1)
    one_tokens, one_logprob_bits = run()
    assert tokens == one_tokens
    assert torch.equal(logprob_bits, one_logprob_bits)
    # Negative control: the samples of a request (one stream each) differ, so the tokens follow the numbers drawn.
    assert len({tuple(t) for t in tokens[:3]}) == 3


def test_threads_option_sets_generation_threads_on_the_driving_thread_only():
    """``threads`` holds while the scheduler runs, on the thread that drives it; the caller's count
    comes back after, and another thread's (the trainer's, beside it) never changes."""
    import threading

    torch.set_num_threads(2)  # the autouse fixture restores the previous setting
    seen: dict[str, list[int]] = {}
    for threads in (1, None):
        eng = engine(threads=threads, one_thread_below_macs=0)
        original = eng._forward_rows

        def recording(*args, _seen=seen.setdefault(str(threads), []), _original=original, **kwargs):
            _seen.append(torch.get_num_threads())
            return _original(*args, **kwargs)

        eng._forward_rows = recording
        driver = threading.Thread(target=lambda: (torch.set_num_threads(2), eng.generate([request(prompt(5), "a", max_tokens=4)]),
                                                  seen.setdefault(f"after {threads}", []).append(torch.get_num_threads())))
        driver.start()
        driver.join()
        assert torch.get_num_threads() == 2  # this (trainer) thread
    assert set(seen["1"]) == {1} and set(seen["None"]) == {2}  # negative control: without the option, the caller's
    assert seen["after 1"] == [2] and seen["after None"] == [2]


def test_steps_below_one_thread_below_macs_run_on_one_thread(reference):
    """Each step sizes its threads from its work: rows x the model's weights per token against
    ``one_thread_below_macs``. Samples finish at different lengths, so the rows shrink mid-generation."""
    torch.set_num_threads(2)  # the autouse fixture restores the previous setting
    lengths = (2, 4, 6, 8, 10, 12)
    requests = [request(prompt(3, i), f"r{i}", seed=i, max_tokens=m) for i, m in enumerate(lengths)]
    eng = engine()
    # TINY_QWEN3 per layer: q 64x128, k and v 64x64, o 128x64, gate and up 64x128, down 128x64,
    # norms 64 + 64 + 32 + 32; two layers, the final norm 64 and the tied head 512x64 (the
    # embedding lookup is no product).
    layer = 64 * 128 + 2 * 64 * 64 + 128 * 64 + 2 * 64 * 128 + 128 * 64 + 192
    assert eng.macs_per_token == 2 * layer + 64 + 512 * 64
    runs: dict[int, list[tuple[int, int]]] = {}
    for limit in (4 * eng.macs_per_token, 0, 1 << 40):
        eng = engine(one_thread_below_macs=limit)
        original, seen = eng._iterate, runs.setdefault(limit, [])

        def recording(admitted, _seen=seen, _original=original):
            assert not admitted or len(eng._active) == 0
            rows = len(eng._active) + sum(len(g) for g in admitted)
            _seen.append((rows, torch.get_num_threads()))
            return _original(admitted)

        eng._iterate = recording
        samples = [s for g in eng.generate(requests) for s in g]
        assert [len(s.token_ids) for s in samples] == list(lengths)
        assert_logprobs_match(reference, samples)
        assert torch.get_num_threads() == 2  # the caller's, back
    decode = runs[4 * eng.macs_per_token][1:]  # (the first step prefills 6 prompts of 3 tokens too)
    assert runs[4 * eng.macs_per_token][0] == (6, 2)
    assert {rows for rows, _ in decode} == {5, 4, 3, 2, 1}  # (the shortest sample ends in the first step)
    assert all(threads == (1 if rows < 4 else 2) for rows, threads in decode)
    assert {t for _, t in runs[0]} == {2}  # 0: never one thread
    assert {t for _, t in runs[1 << 40]} == {1}


DRIVER_TEAM_PROBE = """
import os, sys, torch
import skyrl_torch.engine
from skyrl_core.config.schema import ModelConfig
from skyrl_core.testing.engine_contract import TINY_QWEN3, request
from skyrl_torch.options import TorchEngineOptions
if "keep" in sys.argv:  # the negative control: the driver keeps its team
    skyrl_torch.engine.release_thread_team = lambda: True
eng = skyrl_torch.engine.TorchEngine(ModelConfig(config=dict(TINY_QWEN3)), TorchEngineOptions(), seed=0)
tasks = lambda: len(os.listdir("/proc/self/task"))
torch.ones(1 << 20).exp_()  # a parallel region on 2 threads: this thread has a team
before = tasks()
eng.generate([request([65, 66, 67], "a", n=4, max_tokens=4)])
print(before, tasks())
"""


@pytest.mark.skipif(sys.platform != "linux", reason="counts threads in /proc")
def test_the_driving_thread_releases_its_openmp_team_when_it_stops_driving():
    """The next driver may be another thread, whose team would be throttled beside an idle one
    (``skyrl_core.openmp_teams``): a driver ends its team when it stops driving."""
    import os

    from skyrl_core.openmp_teams import _libgomp

    if _libgomp() is None:
        pytest.skip("torch does not run on libgomp here: nothing to release")
    env = {**os.environ, "OMP_NUM_THREADS": "2"}
    counts = {}
    for mode in ("release", "keep"):
        out = subprocess.run([sys.executable, "-c", DRIVER_TEAM_PROBE, mode], capture_output=True, text=True, env=env, check=True)
        counts[mode] = [int(v) for v in out.stdout.split()[-2:]]
    before, after = counts["release"]
    assert after == before - 1  # the team's one worker is gone
    before, after = counts["keep"]
    assert after == before  # negative control: without the release the worker stays


def test_native_weight_views_follow_update_weights(reference):
    """The native decoder stacks q/k/v and gate/up into fused tensors that the parameters view."""
    eng = engine()
    name = "model.layers.1.self_attn.k_proj.weight"
    new = torch.randn(dict(reference.named_parameters())[name].shape)
    eng.update_weights([(name, new)])
    fused = eng.native.layers[1].qkv_weight
    q_rows = eng.model.model.layers[1].self_attn.q_proj.weight.shape[0]
    assert torch.equal(fused[q_rows : q_rows + new.shape[0]], new)


def _bits(groups) -> torch.Tensor:
    return torch.tensor([lp for g in groups for s in g for lp in s.logprobs], dtype=torch.float32).view(torch.int32)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_prepacked_gemm_operands_give_the_plain_weights_bits_and_follow_update_weights(reference, dtype):
    """oneDNN-prepacked weight copies (bf16 too: bf16 copies where oneDNN computes bf16 on this CPU,
    fp32 copies where it does not, ``gemm: onednn_fp32``): the same kernel without its per-call
    reorder, so the same bits; ``update_weights`` renews them (negative control: without that they
    go stale)."""
    model = attrs.evolve(MODEL, dtype=dtype)

    def make(**options) -> TorchEngine:  # (every product on oneDNN: the tiny model's would go through torch)
        return TorchEngine(model, TorchEngineOptions(torch_gemm_below_macs=0, **options), seed=0)

    packed, plain, stale = make(), make(prepack_weights=False), make()
    expected = 2 * 4 + 1  # qkv, o, gate_up, down; lm_head
    assert packed.execution_contract()["prepacked_gemm_operands"] == expected
    assert plain.execution_contract()["prepacked_gemm_operands"] == 0
    requests = [request(prompt(5), "a", n=2, max_tokens=8, seed=3), request(prompt(11), "b", max_tokens=8, seed=4)]
    assert torch.equal(_bits(packed.generate(requests)), _bits(plain.generate(requests)))
    new = load_causal_lm(model, seed=5)
    stale.native.repack = lambda: None
    for eng in (packed, plain, stale):
        eng.update_weights((n, p.detach()) for n, p in new.named_parameters())
    after = packed.generate(requests)
    assert torch.equal(_bits(after), _bits(plain.generate(requests)))
    if dtype == "float32":  # bf16 logprobs are checked against a reference in test_bf16_* below
        assert_logprobs_match(new, [s for g in after for s in g])
    assert not torch.equal(_bits(stale.generate(requests)), _bits(after))


def test_products_below_torch_gemm_below_macs_go_through_torch_and_the_rest_through_onednn(reference, monkeypatch):
    """Each fp32 product picks its GEMM by its multiply-adds (rows x in x out): below
    ``torch_gemm_below_macs`` torch on the weight itself, else oneDNN on the packed copy. The tiny
    model's products straddle 2^20 at 64 rows and fall below it as samples finish."""
    from skyrl_torch import native_decoder

    requests = [request(prompt(3, i), f"r{i}", n=8, seed=i, max_tokens=2 + 2 * i) for i in range(8)]
    to_torch: list[int] = []
    real_linear, real_residual = native_decoder._torch_linear, native_decoder._torch_residual_linear
    monkeypatch.setattr(native_decoder, "_torch_linear", lambda x, w, b=None: to_torch.append(x.numel() * w.shape[0]) or real_linear(x, w, b))
    monkeypatch.setattr(native_decoder, "_torch_residual_linear",
                        lambda r, x, w, b: to_torch.append(x.numel() * w.shape[0]) or real_residual(r, x, w, b))

    def run(limit: int) -> tuple[list[int], list[int], list]:
        eng = engine(torch_gemm_below_macs=limit)
        to_onednn: list[int] = []
        onednn, onednn_add = eng.native._linear, eng.native._residual_linear
        eng.native._linear = lambda x, w, b=None: to_onednn.append(x.numel() * w.shape[0]) or onednn(x, w, b)
        eng.native._residual_linear = lambda r, x, w, b: to_onednn.append(x.numel() * w.shape[0]) or onednn_add(r, x, w, b)
        to_torch.clear()
        samples = [s for g in eng.generate(requests) for s in g]
        return list(to_torch), to_onednn, samples

    limit = 1 << 20
    small, large, samples = run(limit)
    assert small and large and max(small) < limit <= min(large)
    assert_logprobs_match(reference, samples)
    assert run(0)[0] == [] and run(1 << 40)[1] == []  # 0: every product on oneDNN; above all: none


def test_native_refused_for_an_unsupported_architecture():
    gpt2 = ModelConfig(config={"model_type": "gpt2", "n_embd": 64, "n_layer": 2, "n_head": 2, "vocab_size": 512, "n_positions": 128})
    with pytest.raises(ValueError, match="model_type 'gpt2'"):
        TorchEngine(gpt2, TorchEngineOptions(implementation="native"))


def test_any_causal_lm_runs_through_transformers_modules():
    gpt2 = ModelConfig(config={"model_type": "gpt2", "n_embd": 64, "n_layer": 2, "n_head": 2, "vocab_size": 512, "n_positions": 128})
    eng = TorchEngine(gpt2, TorchEngineOptions())  # auto: falls back to the model's modules
    assert eng.execution_contract()["implementation"] == "transformers"
    ref = load_causal_lm(gpt2, seed=0)
    out = eng.generate([request(prompt(6), "g", temperature=0.0, max_tokens=6, n=2), request(prompt(2), "h", seed=1, max_tokens=6)])
    assert list(out[0][0].token_ids) == argmax_decode(ref, prompt(6), 6)
    assert_logprobs_match(ref, [s for g in out for s in g])


# --- errors -------------------------------------------------------------------------------------------


def test_threads_beside_training_follow_the_trainer_step_by_step():
    """``threads_beside_training`` holds for the decode steps taken while the trainer says it
    computes, and ``threads`` (else the caller's count) for the others, switching mid-generation."""
    from skyrl_core.compute_share import set_trainer_computing, trainer_computing

    torch.set_num_threads(2)  # the autouse fixture restores the previous setting
    runs: dict[str, list[tuple[bool, int]]] = {}
    for name, options in (("beside=1", {"threads_beside_training": 1}), ("beside=1 threads=2", {"threads_beside_training": 1, "threads": 2}),
                          ("unset", {})):
        eng = engine(**options, one_thread_below_macs=0)
        original, seen = eng._iterate, runs.setdefault(name, [])

        def recording(*args, _seen=seen, _original=original, **kwargs):
            _seen.append((trainer_computing(), torch.get_num_threads()))  # as the step was sized
            try:
                return _original(*args, **kwargs)
            finally:
                set_trainer_computing(len(_seen) % 3 == 1)  # the trainer starts and stops between steps

        eng._iterate = recording
        set_trainer_computing(False)
        try:
            eng.generate([request(prompt(5), "a", max_tokens=8)])
        finally:
            set_trainer_computing(False)
        assert torch.get_num_threads() == 2  # the caller's, back
    for name in ("beside=1", "beside=1 threads=2"):
        assert {t for computing, t in runs[name] if computing} == {1}
        assert {t for computing, t in runs[name] if not computing} == {2}
    assert {t for _, t in runs["unset"]} == {2}  # negative control: without the option the trainer is not asked
    assert any(computing for computing, _ in runs["unset"])


def test_threads_beside_training_is_refused_for_an_engine_in_its_own_process():
    from types import SimpleNamespace

    from skyrl_torch.preflight import problems

    config = SimpleNamespace(engine=SimpleNamespace(placement="separate"))
    (problem,) = problems(config, TorchEngineOptions(threads_beside_training=1))
    assert "engine.options.threads_beside_training: 1 needs engine.placement: colocated" in problem and "'separate'" in problem
    assert problems(config, TorchEngineOptions(threads=1)) == []
    assert problems(SimpleNamespace(engine=SimpleNamespace(placement="colocated")), TorchEngineOptions(threads_beside_training=1)) == []


@pytest.mark.parametrize(
    "field, value, message",
    [("max_num_seqs", 0, "max_num_seqs must be an integer >= 1"), ("implementation", "fast", "implementation must be one of"),
     ("attention", "flash", "attention must be one of"), ("max_model_len", -1, "max_model_len must be"),
     ("prepack_weights", "yes", "prepack_weights must be true or false"), ("threads", 0, "threads must be"),
     ("threads_beside_training", 0, "threads_beside_training must be"), ("one_thread_below_macs", -1, "one_thread_below_macs must be"),
     ("torch_gemm_below_macs", -2, "torch_gemm_below_macs must be")],
)
def test_options_are_validated(field, value, message):
    with pytest.raises(ValueError, match=message):
        TorchEngineOptions(**{field: value})


@pytest.mark.parametrize(
    "prompt_ids, sampling, message",
    [((), {}, "has an empty prompt"), ((1, 600), {}, r"outside the vocabulary \[0, 512\)"),
     ((1, 2), {"top_p": 0.0}, "top_p must be in"), ((1, 2), {"max_tokens": 0}, "max_tokens must be integers >= 1"),
     ((1, 2), {"max_tokens": 300}, "exceeds max_model_len 256"), ((1, 2), {"stop": ("",)}, "empty string"),
     ((1, 2), {"temperature": float("nan")}, "temperature must be a finite number"), ((1, 2), {"seed": 1 << 70}, "seed must be None")],
)
def test_bad_requests_are_refused_naming_the_request(prompt_ids, sampling, message):
    eng = engine()
    with pytest.raises(ValueError, match=message) as info:
        eng.generate([request(prompt_ids, "bad-one", **sampling)])
    assert "bad-one" in str(info.value)


def test_a_failing_prefill_reaches_its_caller_and_the_engine_serves_on():
    """An error in a prefill is raised to the caller whose samples it was computing, never returned
    as samples cut short (it was: a prefill that raised left its samples empty, 'length'), and the
    engine serves the next call."""
    eng = TorchEngine(MODEL, TorchEngineOptions(), seed=0)
    original = eng._forward

    def failing(*args, **kwargs):
        raise RuntimeError("injected prefill failure")

    eng._forward = failing
    with pytest.raises(RuntimeError, match="injected prefill failure"):
        eng.generate([request(prompt(5), "a", n=2, max_tokens=4, seed=0)])
    eng._forward = original
    (group,) = eng.generate([request(prompt(5), "a", n=2, max_tokens=4, seed=0)])
    assert [len(s.token_ids) for s in group] == [4, 4]


def test_closed_engine_refuses_work():
    eng = engine()
    eng.close()
    with pytest.raises(RuntimeError, match="closed"):
        eng.generate([request(prompt(2), "x")])


def test_sleep_frees_the_kv_cache_and_the_prepacked_copies():
    """Asleep, the engine holds its weights only (no KV cache, no packed copies); weights loaded
    meanwhile are packed at wake: the same bits as an engine that never slept."""
    eng, awake = engine(), engine()
    packed = eng.execution_contract()["prepacked_gemm_operands"]
    assert packed == 2 * 4 + 1
    requests = [request(prompt(5), "a", n=2, max_tokens=6, seed=3)]
    eng.generate(requests)
    assert eng._cache is not None and eng._cache.nbytes > 0
    eng.sleep()
    assert eng._cache is None and eng.native.prepacked == 0
    assert eng.native.layers[0].qkv_gemm is eng.native.layers[0].qkv_weight
    new = load_causal_lm(MODEL, seed=5)
    for e in (eng, awake):
        e.update_weights((n, p.detach()) for n, p in new.named_parameters())
    assert eng.native.prepacked == 0  # still asleep: packed at wake, once
    eng.wake()
    assert eng.execution_contract()["prepacked_gemm_operands"] == packed
    assert torch.equal(_bits(eng.generate(requests)), _bits(awake.generate(requests)))


# --- bf16 and registration ---------------------------------------------------------------------------


def test_bf16_smoke():
    from skyrl_core.ops.onednn import bf16_supported

    bf16 = attrs.evolve(MODEL, dtype="bfloat16")
    eng = TorchEngine(bf16, TorchEngineOptions(), seed=0)
    assert eng.execution_contract()["model_dtype"] == "bfloat16"
    # oneDNN bf16 only where it has bf16 products (AVX-512 or newer): on an AVX2-only CPU it cannot
    # create the primitive, and PyTorch's bf16 GEMM is 5-50x slower than fp32 there, so the default
    # cpu_gemm=onednn multiplies in fp32 on oneDNN and rounds to bf16.
    assert eng.execution_contract()["gemm"] == ("onednn" if bf16_supported() else "onednn_fp32")
    out = eng.generate([request(prompt(5, i), str(i), n=2, seed=i, max_tokens=8) for i in range(3)])
    ref = load_causal_lm(bf16, seed=0)
    for group in out:
        for s in group:
            assert len(s.token_ids) == 8 or s.stop_reason == "stop"
            got = torch.tensor(s.logprobs)
            assert torch.isfinite(got).all() and (got <= 0).all()
            # bf16 cache/decode vs a bf16 full forward: close, not equal.
            assert (got - full_forward_logprobs(ref, s.prompt_token_ids, s.token_ids)).abs().max() < 0.1


def test_plugin_registers_the_engine_without_importing_torch():
    code = (
        "import sys\n"
        "from skyrl_torch import plugin\n"
        "records = []\n"
        "plugin.skyrl_register_inference_engines(records.append)\n"
        "assert 'torch' not in sys.modules, 'plugin.py imported torch'\n"
        "from skyrl_core.plugins.records import import_object\n"
        "import_object(records[0].options)()\n"
        "assert 'torch' not in sys.modules, 'options imported torch'\n"
        "print(records[0].name, records[0].factory)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["torch", "skyrl_torch.engine:TorchEngine"]


def test_registered_in_the_plugin_manager(fresh_plugin_manager):
    spec = fresh_plugin_manager.spec("inference_engine", "torch")
    assert spec.load_factory() is TorchEngine
    assert spec.load_options_class() is TorchEngineOptions


def test_installed_ops_walk_needs_every_walked_op_installed_at_both_engine_sites():
    import attrs

    from skyrl_core.ops.install import DEFAULT_IMPLS
    from skyrl_core.ops.ledger import OpLedger
    from skyrl_torch.installed_ops_decoder import ENGINE_SITES, WALKED_OPS, missing_ops

    ledger = OpLedger(role="engine")
    for site in ENGINE_SITES:
        for op in WALKED_OPS:
            ledger.declare(op, site, attrs.evolve(DEFAULT_IMPLS[op], name=f"plugin.{op}"))
    assert missing_ops(ledger) == []
    ledger.declare("rope", "engine_decode", DEFAULT_IMPLS["rope"])  # one stock op at one site
    assert missing_ops(ledger) == ["rope@engine_decode"]
