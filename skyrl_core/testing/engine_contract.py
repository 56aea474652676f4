"""The contract test-suite of ``skyrl_core.interfaces.InferenceEngine``.

An engine's tests subclass ``EngineContract`` and provide an ``engine_factory`` fixture of class
scope (or wider) that returns ``make(model: ModelConfig, seed: int) -> InferenceEngine``::

    class TestMyEngine(EngineContract):
        @pytest.fixture(scope="class")
        @classmethod
        def engine_factory(cls):
            return lambda model, seed: MyEngine(model, MyOptions(), seed=seed)

The engine built from ``model_config`` (default: a tiny Qwen3 built from a config; override the
fixture to change it) must hold the same weights as ``reference_model`` (default:
``skyrl_core.models.load_causal_lm(model_config, seed=0)`` in fp32; override it when the engine
loads weights another way). The suite checks:

- one list of ``n`` samples per request, in request order, with ``sample_index`` 0..n-1;
- seeded determinism: the same request and seed give the same tokens alone and inside a batch of
  other requests; different seeds (and different samples of one request) differ;
- ``max_tokens`` ends a sample with ``"length"``; a stop token id or a stop string ends it with
  ``"stop"`` at the right token (the text excludes the stop string, ``token_ids`` end at the token
  that completed it), the earliest of several stop strings wins;
- temperature 0 (and top-k 1, and a tiny top-p) equal argmax decoding by full forwards of the
  reference model;
- every token's logprob equals the reference model's full-forward fp32 log-softmax within
  ``logprob_atol`` (1e-5), whatever temperature / top-k / top-p sampled it (negative control: the
  temperature-scaled distribution is measurably different);
- ``update_weights`` makes outputs follow the new weights (and back); unknown names and wrong
  shapes are refused naming the tensor; an ``lm_head.weight`` given alone is followed, on a model
  tying it to the embedding too (the embedding keeps its values: skyrl-torch unties) unless the
  engine declares ``unties_unembedding = False``, and then it is refused naming ``lm_head``
  (vLLM and SGLang load no lm_head of a tied model: never dropped silently);
- ``pause``/``resume`` (engines with ``supports_pause``): a pause stops in-flight samples at a token
  boundary (no progress while paused, by the engine's ``in_flight()`` bookkeeping); weights loaded
  while paused take effect from the next token (each token stamped with its policy version, the
  count before the switch equal to what the bookkeeping showed at the pause); after ``resume`` the
  same requests finish with no token lost or duplicated (equal to an uninterrupted run when the
  weights are the same). Engines without it refuse ``pause`` with ``NotImplementedError``;
- ``recompute_kv`` (engines with ``supports_kv_recompute``), called while paused after the update:
  the tokens after the switch have the logprobs of a full forward of the new weights over their
  whole context (the recomputed keys/values), where without it (negative control) they do not;
  with the same weights, the same tokens as an uninterrupted run, none lost or duplicated;
- ``sleep``/``wake`` keep generation working and unchanged; ``close`` is idempotent;
- ``execution_contract()`` is JSON-able and names the engine's op sites.
"""

from __future__ import annotations

import copy
import json
import threading
import time
from typing import Any, Callable, Sequence

import pytest
import torch

from skyrl_core.config.schema import ModelConfig
from skyrl_core.testing import backend_contract
from skyrl_core.types import GeneratedSample, GenerationRequest, SamplingParams

TINY_QWEN3 = {
    **backend_contract.TINY_QWEN3,
    # Larger than the default 0.02 so that next-token distributions are peaked rather than
    # near-uniform: argmax gaps far above float noise, seeds that visibly matter.
    "initializer_range": 0.2,
}
# The same body with untied input/output embeddings (Llama's layout).
TINY_LLAMA = {**TINY_QWEN3, "model_type": "llama", "tie_word_embeddings": False}

# TINY_QWEN3's attention with a sparse MoE MLP in every layer (8 experts, 2 per token).
TINY_QWEN3_MOE = {
    **TINY_QWEN3,
    "model_type": "qwen3_moe",
    "num_experts": 8,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 32,
    "decoder_sparse_step": 1,
    "norm_topk_prob": True,
    "tie_word_embeddings": False,
}

MODEL_SEED = 0

# Printable-ASCII token ids (bytes for a ByteTokenizer; arbitrary tokens for a real vocabulary).
# A hybrid decoder: GatedDeltaNet linear-attention layers (a recurrent state per sequence) around
# an attention layer, with MoE. For engines that run models with ``layer_types`` beyond attention.
TINY_QWEN3_NEXT = {
    "model_type": "qwen3_next",
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 3,
    "layer_types": ["linear_attention", "full_attention", "linear_attention"],
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "linear_num_value_heads": 4,
    "linear_num_key_heads": 2,
    "linear_key_head_dim": 16,
    "linear_value_head_dim": 16,
    "linear_conv_kernel_dim": 4,
    "num_experts": 4,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 32,
    "shared_expert_intermediate_size": 32,
    "vocab_size": 512,
    "max_position_embeddings": 256,
    "tie_word_embeddings": False,
    # Peaked like TINY_QWEN3, but not 0.2: there transformers' chunked delta rule (a full forward,
    # the reference) and its recurrent one-token decode already differ by ~3e-5 in fp32.
    "initializer_range": 0.1,
}

CONTRACT_PROMPTS: tuple[tuple[int, ...], ...] = (
    (72, 101, 108, 108, 111, 44, 32, 119),
    (49, 43, 50, 61),
    (84, 104, 101, 32, 113, 117, 105, 99, 107, 32, 98, 114, 111, 119, 110),
    (65,),
)


def request(prompt: Sequence[int], request_id: str = "r", **sampling: Any) -> GenerationRequest:
    return GenerationRequest(request_id=request_id, prompt_token_ids=tuple(prompt), sampling=SamplingParams(**sampling))


def full_forward_logprobs(model: torch.nn.Module, prompt: Sequence[int], tokens: Sequence[int]) -> torch.Tensor:
    """fp32 log-softmax of ``tokens`` after ``prompt``, from one full forward of the whole sequence."""
    ids = torch.tensor([list(prompt) + list(tokens)])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0].float()
    logp = torch.log_softmax(logits, dim=-1)
    positions = torch.arange(len(prompt) - 1, len(prompt) + len(tokens) - 1)
    return logp[positions, torch.tensor(list(tokens), dtype=torch.long)]


def worst_logprob_error(model: torch.nn.Module, groups: Sequence[Sequence[Any]]) -> float:
    """Largest |engine logprob - ``full_forward_logprobs``| over every sample of ``generate``'s groups."""
    return max(
        float((torch.tensor(s.logprobs) - full_forward_logprobs(model, s.prompt_token_ids, s.token_ids)).abs().max())
        for group in groups
        for s in group
    )


def argmax_decode(model: torch.nn.Module, prompt: Sequence[int], max_tokens: int) -> list[int]:
    """Greedy decoding by a full forward per token (no cache): the reference for temperature 0."""
    tokens: list[int] = []
    with torch.no_grad():
        for _ in range(max_tokens):
            logits = model(input_ids=torch.tensor([list(prompt) + tokens])).logits[0, -1]
            tokens.append(int(logits.argmax()))
    return tokens


class EngineContract:
    """Subclass it and provide ``engine_factory`` (class scope); see the module docstring."""

    logprob_atol: float = 1e-5
    # False: an engine whose model, when tied, cannot take an lm_head of its own (it refuses one).
    unties_unembedding: bool = True

    # --- fixtures ----------------------------------------------------------------------------

    @pytest.fixture(scope="class")
    @classmethod
    def model_config(cls) -> ModelConfig:
        return ModelConfig(config=dict(TINY_QWEN3))

    @pytest.fixture(scope="class")
    @classmethod
    def engine_factory(cls) -> Callable[[ModelConfig, int], Any]:
        raise NotImplementedError("an EngineContract subclass must provide the engine_factory fixture")

    @pytest.fixture(scope="class")
    @classmethod
    def engine(cls, engine_factory, model_config):
        """The engine most tests share; tests that change its weights restore them."""
        engine = engine_factory(model_config, MODEL_SEED)
        yield engine
        engine.close()

    @pytest.fixture(scope="class")
    @classmethod
    def reference_model(cls, model_config) -> torch.nn.Module:
        import attrs

        from skyrl_core.models import load_causal_lm

        return load_causal_lm(attrs.evolve(model_config, dtype="float32"), seed=MODEL_SEED).eval()

    @pytest.fixture(scope="class")
    @classmethod
    def tokenizer(cls, model_config) -> Any:
        from skyrl_core.models import load_tokenizer

        return load_tokenizer(model_config)

    @pytest.fixture(scope="class")
    @classmethod
    def prompts(cls) -> tuple[tuple[int, ...], ...]:
        return CONTRACT_PROMPTS

    # --- shape of the answer -------------------------------------------------------------------

    def test_one_list_of_n_samples_per_request_in_order(self, engine, prompts):
        requests = [request(p, f"req-{i}", n=n, max_tokens=6, seed=i) for i, (p, n) in enumerate(zip(prompts, (1, 3, 2, 1)))]
        out = engine.generate(requests)
        assert len(out) == len(requests)
        for req, group in zip(requests, out):
            assert len(group) == req.sampling.n
            for index, sample in enumerate(group):
                assert isinstance(sample, GeneratedSample)
                assert sample.request_id == req.request_id
                assert sample.sample_index == index
                assert tuple(sample.prompt_token_ids) == req.prompt_token_ids
                assert 1 <= len(sample.token_ids) <= 6
                assert len(sample.logprobs) == len(sample.token_ids)
                assert sample.stop_reason in ("stop", "length")
                if len(sample.token_ids) < 6:
                    assert sample.stop_reason == "stop"
        assert engine.generate([]) == []

    # --- seeds ---------------------------------------------------------------------------------

    def test_same_seed_same_tokens_whatever_the_batch(self, engine, prompts):
        target = request(prompts[0], "target", n=2, max_tokens=12, seed=7, temperature=1.0)
        alone = engine.generate([target])[0]
        again = engine.generate([target])[0]
        others = [request(p, f"other-{i}", n=3, max_tokens=5 + i, seed=100 + i) for i, p in enumerate(prompts[1:])]
        in_batch = engine.generate([others[0], target, *others[1:]])[1]
        for a, b, c in zip(alone, again, in_batch):
            assert a.token_ids == b.token_ids == c.token_ids
            assert max(abs(x - y) for x, y in zip(a.logprobs, c.logprobs)) <= self.logprob_atol

    def test_same_seed_same_tokens_when_the_batch_exceeds_a_steps_token_budget(self, engine, prompts):
        """Prompts summing to more tokens than one step takes (vLLM's budget: 2048-4096 tokens):
        the engine must not split a prompt in a way that breaks a seed (vLLM-CPU's chunked
        prefill rewinds a seeded generator, which CPU generators cannot do: the engine died)."""
        long_prompt = [t for _ in range(40) for t in prompts[1]][:120]
        target = request(prompts[0], "target", n=2, max_tokens=6, seed=11, temperature=1.0)
        alone = engine.generate([target])[0]
        crowd = [request(long_prompt, f"long-{i}", n=2, max_tokens=2, seed=200 + i) for i in range(20)]
        out = engine.generate([*crowd[:10], target, *crowd[10:]])  # 40 samples of 120 prompt tokens
        assert [s.token_ids for s in out[10]] == [s.token_ids for s in alone]
        assert all(len(group) == 2 and all(s.token_ids for s in group) for group in out)

    def test_different_seeds_and_samples_differ(self, engine, prompts):
        out = engine.generate(
            [request(prompts[2], "a", seed=1, n=2, max_tokens=16), request(prompts[2], "b", seed=2, max_tokens=16)]
        )
        (a0, a1), (b0,) = out
        assert a0.token_ids != b0.token_ids
        assert a0.token_ids != a1.token_ids

    # --- stopping ------------------------------------------------------------------------------

    def test_max_tokens_ends_with_length(self, engine, prompts):
        out = engine.generate([request(p, str(i), n=4, max_tokens=5, seed=i) for i, p in enumerate(prompts)])
        samples = [s for group in out for s in group]
        assert any(s.stop_reason == "length" for s in samples)
        for s in samples:
            assert len(s.token_ids) == 5 if s.stop_reason == "length" else len(s.token_ids) <= 5

    def test_stop_token_id_ends_at_that_token(self, engine, prompts):
        base = request(prompts[2], "s", seed=3, max_tokens=16)
        free = engine.generate([base])[0][0]
        assert len(free.token_ids) >= 6, "the free run must be long enough to pick a stop token from"
        stop_id = free.token_ids[4]
        cut = free.token_ids.index(stop_id) + 1
        stopped = engine.generate([request(prompts[2], "s", seed=3, max_tokens=16, stop_token_ids=(stop_id,))])[0][0]
        assert stopped.stop_reason == "stop"
        assert stopped.token_ids == free.token_ids[:cut]
        assert stopped.logprobs == pytest.approx(free.logprobs[:cut], abs=self.logprob_atol)

    def test_stop_string_ends_at_the_token_that_completes_it(self, engine, tokenizer, prompts):
        base = dict(seed=11, max_tokens=24, temperature=1.0)
        free = engine.generate([request(prompts[0], "s", **base)])[0][0]
        text = free.text
        # Two single-character stop strings from the free text (ASCII letters/digits decode the
        # same in every prefix); whichever occurs first must end the sample.
        candidates = [i for i, ch in enumerate(text) if ch.isascii() and ch.isalnum() and i > 0]
        assert len(candidates) >= 2, f"the free run produced too little plain text: {text!r}"
        stops = (text[candidates[-1]], text[candidates[0]])
        first = min(text.find(s) for s in stops)
        stopped = engine.generate([request(prompts[0], "s", stop=stops, **base)])[0][0]
        assert stopped.stop_reason == "stop"
        assert stopped.text == text[:first]
        n = len(stopped.token_ids)
        assert stopped.token_ids == free.token_ids[:n]
        assert any(s in tokenizer.decode(stopped.token_ids, skip_special_tokens=True) for s in stops)
        assert not any(s in tokenizer.decode(stopped.token_ids[:-1], skip_special_tokens=True) for s in stops)

    # --- greedy and logprobs against the reference model ---------------------------------------

    @pytest.mark.parametrize(
        "sampling", [dict(temperature=0.0), dict(temperature=1.0, top_k=1), dict(temperature=0.8, top_p=1e-6)],
        ids=["temperature0", "top_k1", "top_p_tiny"],
    )
    def test_greedy_equals_reference_argmax(self, engine, reference_model, prompts, sampling):
        out = engine.generate([request(p, str(i), n=2, max_tokens=8, seed=i, **sampling) for i, p in enumerate(prompts[:3])])
        for p, group in zip(prompts, out):
            expected = argmax_decode(reference_model, p, 8)
            for s in group:
                assert list(s.token_ids) == expected[: len(s.token_ids)]
                assert len(s.token_ids) == 8 or s.stop_reason == "stop"

    @pytest.mark.parametrize(
        "sampling",
        [dict(temperature=1.0), dict(temperature=0.7, top_k=20), dict(temperature=1.3, top_p=0.9), dict(temperature=0.0)],
        ids=["t1", "t0.7_topk20", "t1.3_topp0.9", "greedy"],
    )
    def test_logprobs_equal_reference_log_softmax(self, engine, reference_model, prompts, sampling):
        out = engine.generate([request(p, str(i), n=2, max_tokens=10, seed=20 + i, **sampling) for i, p in enumerate(prompts)])
        worst = 0.0
        for p, group in zip(prompts, out):
            for s in group:
                expected = full_forward_logprobs(reference_model, p, s.token_ids)
                got = torch.tensor(s.logprobs, dtype=torch.float32)
                worst = max(worst, (got - expected).abs().max().item())
                assert torch.all(got <= 0)
        assert worst <= self.logprob_atol, f"max |engine - reference| = {worst:.3g}"

    def test_logprobs_are_not_temperature_scaled(self, engine, reference_model, prompts):
        """Negative control for the test above: at temperature 0.5 the scaled distribution differs."""
        s = engine.generate([request(prompts[2], "t", seed=5, max_tokens=10, temperature=0.5)])[0][0]
        ids = torch.tensor([list(prompts[2]) + list(s.token_ids)])
        with torch.no_grad():
            logits = reference_model(input_ids=ids).logits[0].float()
        positions = torch.arange(len(prompts[2]) - 1, ids.shape[1] - 1)
        scaled = torch.log_softmax(logits / 0.5, dim=-1)[positions, torch.tensor(s.token_ids)]
        raw = torch.log_softmax(logits, dim=-1)[positions, torch.tensor(s.token_ids)]
        got = torch.tensor(s.logprobs)
        assert (got - raw).abs().max() <= self.logprob_atol
        assert (got - scaled).abs().max() > 1e-3

    # --- weights ---------------------------------------------------------------------------------

    def test_update_weights_changes_outputs_to_the_new_weights(self, engine, reference_model, prompts):
        original = {name: p.detach().clone() for name, p in reference_model.named_parameters()}
        gen = torch.Generator().manual_seed(1234)
        perturbed = {name: p + 0.1 * torch.randn(p.shape, generator=gen) for name, p in original.items()}
        new_model = copy.deepcopy(reference_model)
        new_model.load_state_dict(perturbed, strict=False)
        greedy = [request(p, str(i), temperature=0.0, max_tokens=8) for i, p in enumerate(prompts[:3])]
        before = engine.generate(greedy)
        try:
            engine.update_weights(perturbed.items())
            after = engine.generate(greedy)
            sampled = engine.generate([request(prompts[0], "x", seed=9, max_tokens=8)])[0][0]
        finally:
            engine.update_weights(original.items())
        for p, b, a in zip(prompts, before, after):
            assert list(a[0].token_ids) == argmax_decode(new_model, p, 8)[: len(a[0].token_ids)]
        assert [g[0].token_ids for g in before] != [g[0].token_ids for g in after]
        expected = full_forward_logprobs(new_model, prompts[0], sampled.token_ids)
        assert (torch.tensor(sampled.logprobs) - expected).abs().max() <= self.logprob_atol
        restored = engine.generate(greedy)
        assert [g[0].token_ids for g in restored] == [g[0].token_ids for g in before]

    def test_an_unembedding_given_alone_is_followed_and_never_written_into_a_tied_embedding(self, engine, reference_model, prompts):
        """``lm_head.weight`` alone, other than the embedding (a LoRA adapter merged into the
        unembedding only): greedy tokens and logprobs follow a reference whose lm_head alone
        changed; on a tied model the embedding keeps its values (negative control: a head
        written into the shared tensor changes the embedding, and the outputs with it)."""
        tied = reference_model.get_output_embeddings().weight is reference_model.get_input_embeddings().weight
        head = reference_model.get_output_embeddings().weight.detach().clone()
        new_head = head + 0.2 * torch.randn(head.shape, generator=torch.Generator().manual_seed(77))
        if tied and not self.unties_unembedding:
            with pytest.raises(ValueError, match="lm_head"):
                engine.update_weights([("lm_head.weight", new_head)])
            return
        new_model = copy.deepcopy(reference_model)
        new_model.get_output_embeddings().weight = torch.nn.Parameter(new_head.clone())
        assert torch.equal(new_model.get_input_embeddings().weight, reference_model.get_input_embeddings().weight)
        written_through = copy.deepcopy(reference_model)  # what writing into a tied tensor would compute
        with torch.no_grad():
            written_through.get_output_embeddings().weight.copy_(new_head)
        greedy = [request(p, str(i), temperature=0.0, max_tokens=8) for i, p in enumerate(prompts[:3])]
        before = engine.generate(greedy)
        try:
            engine.update_weights([("lm_head.weight", new_head)])
            after = engine.generate(greedy)
        finally:
            engine.update_weights([("lm_head.weight", head)])
        for p, a in zip(prompts, after):
            assert list(a[0].token_ids) == argmax_decode(new_model, p, 8)[: len(a[0].token_ids)]
            expected = full_forward_logprobs(new_model, p, a[0].token_ids)
            assert (torch.tensor(a[0].logprobs) - expected).abs().max() <= self.logprob_atol
            if tied:
                wrong = full_forward_logprobs(written_through, p, a[0].token_ids)
                assert (wrong - expected).abs().max() > 100 * self.logprob_atol
        assert [g[0].token_ids for g in before] != [g[0].token_ids for g in after]
        assert [g[0].token_ids for g in engine.generate(greedy)] == [g[0].token_ids for g in before]

    def test_update_weights_refuses_unknown_names_and_wrong_shapes(self, engine, reference_model):
        with pytest.raises((KeyError, ValueError), match="no_such_tensor"):
            engine.update_weights([("model.no_such_tensor.weight", torch.zeros(2))])
        name, param = next(iter(reference_model.named_parameters()))
        with pytest.raises(ValueError, match="shape"):
            engine.update_weights([(name, torch.zeros(*param.shape, 3))])

    # --- pause / resume with in-flight weight updates --------------------------------------------

    @pytest.mark.parametrize("kv_on_update", ["keep", "recompute"])
    def test_pause_resume_loses_and_duplicates_no_token(self, engine, reference_model, prompts, kv_on_update):
        if not getattr(engine, "supports_pause", False):
            with pytest.raises(NotImplementedError, match="pause"):
                engine.pause()
            return
        recompute = kv_on_update == "recompute"
        if recompute and not getattr(engine, "supports_kv_recompute", False):
            return  # (trainer.fully_async.kv_on_update=recompute is refused with such an engine)
        # 6 samples: more than a small engine's slots, so some wait (unadmitted) through the pause
        reqs = [request(p, f"p{i}", n=2, max_tokens=40, seed=20 + i) for i, p in enumerate(prompts[:3])]
        expected = engine.generate(reqs)
        original = {name: p.detach().clone() for name, p in reference_model.named_parameters()}
        version = engine.policy_version
        counts_at_pause = self._generate_with_a_pause(engine, reqs, original.items(), version + 1, recompute=recompute)
        got, at_pause = counts_at_pause
        for req, want, have in zip(reqs, expected, got):
            for s_want, s_have in zip(want, have):
                assert list(s_have.token_ids) == list(s_want.token_ids)  # nothing lost, nothing twice
                assert len(s_have.token_versions) == len(s_have.token_ids)
                old = sum(v == version for v in s_have.token_versions)
                assert set(s_have.token_versions) <= {version, version + 1}
                assert list(s_have.token_versions) == sorted(s_have.token_versions)
                # finished before the pause: not in flight, every token of the old version
                assert old == at_pause.get((req.request_id, s_have.sample_index), len(s_have.token_ids))
        assert any(0 < n < 40 for n in at_pause.values()), at_pause  # the pause really was mid-stream

    @pytest.mark.parametrize("kv_on_update", ["keep", "recompute"])
    def test_weights_loaded_while_paused_apply_from_the_next_token(self, engine, reference_model, prompts, kv_on_update):
        if not getattr(engine, "supports_pause", False):
            return  # (refusal checked above)
        recompute = kv_on_update == "recompute"
        if recompute and not getattr(engine, "supports_kv_recompute", False):
            return
        original = {name: p.detach().clone() for name, p in reference_model.named_parameters()}
        gen = torch.Generator().manual_seed(99)
        perturbed = {name: p + 0.3 * torch.randn(p.shape, generator=gen) for name, p in original.items()}
        reqs = [request(prompts[0], "w", n=1, max_tokens=40, temperature=0.0)]
        expected = engine.generate(reqs)[0][0]
        version = engine.policy_version
        try:
            (got,), at_pause = self._generate_with_a_pause(engine, reqs, perturbed.items(), version + 7, recompute=recompute)
            s = got[0]
            switched = at_pause[("w", 0)]
            resumed = tuple(prompts[0]) + tuple(s.token_ids[:switched])
            if recompute:
                # The engine's own decode under the new weights, from the same context, with no pause: how
                # far its token-by-token decode drifts from a full forward there (a hybrid's recurrent
                # step against the chunked forward: up to ~3e-3 on some contexts of these 3x weights).
                fresh = engine.generate([request(resumed, "w-fresh", n=1, max_tokens=len(s.token_ids) - switched,
                                                 temperature=0.0)])[0][0]
        finally:
            engine.update_weights(original.items(), version=version)
        assert list(s.token_versions) == [version] * switched + [version + 7] * (len(s.token_ids) - switched)
        assert list(s.token_ids[:switched]) == list(expected.token_ids[:switched])
        assert list(s.token_ids) != list(expected.token_ids)  # the later tokens follow the new weights
        # Each token's logprob against a full forward of the policy its version names, over the whole
        # context: after the switch that holds only when the context's keys/values were recomputed
        # under the new weights (keep: they are the old weights', a measurably different distribution).
        new_model = copy.deepcopy(reference_model)
        new_model.load_state_dict(perturbed, strict=False)
        got_logprobs = torch.tensor(s.logprobs, dtype=torch.float32)
        old_error = (got_logprobs - full_forward_logprobs(reference_model, prompts[0], s.token_ids))[:switched].abs()
        new_error = (got_logprobs - full_forward_logprobs(new_model, prompts[0], s.token_ids))[switched:].abs()
        assert old_error.max() <= self.logprob_atol and new_error.numel() > 0
        if recompute:
            # After the switch the sample decodes on from keys/values recomputed under the new weights:
            # it is as close to the new policy as the engine's own decode without a pause (keep is off
            # by nats). The first token after the switch is one decode step from the recomputed context.
            drift = float((torch.tensor(fresh.logprobs) - full_forward_logprobs(new_model, resumed, fresh.token_ids)).abs().max())
            bound = max(10 * self.logprob_atol, 3 * drift)
            assert new_error[0] <= max(self.logprob_atol, 3 * drift), f"first token after the switch: {new_error[0]:.3g} (drift {drift:.3g})"
            assert new_error.max() <= bound, f"max |engine - new policy| = {new_error.max():.3g} > {bound:.3g} (drift {drift:.3g})"
        else:
            assert new_error.max() > 1e-1

    @staticmethod
    def _generate_with_a_pause(engine, reqs, weights, version, *, recompute=False):
        """Generate ``reqs`` in a thread; pause once some sample has a few tokens, check that nothing
        moves while paused, load ``weights`` as ``version`` (then ``recompute_kv``), resume. Returns
        the output and the token count of each (request id, sample index) at the pause."""
        result: dict[str, Any] = {}
        thread = threading.Thread(target=lambda: result.update(out=engine.generate(reqs)))
        thread.start()
        deadline = time.monotonic() + 60
        while not any(n >= 3 for n in engine.in_flight().values()):
            assert thread.is_alive() and time.monotonic() < deadline, "generation ended before it could be paused"
            time.sleep(0.0005)
        engine.pause()
        at_pause = engine.in_flight()
        time.sleep(0.05)
        assert engine.in_flight() == at_pause  # nothing moves while paused
        engine.update_weights(weights, version=version)
        if recompute:
            engine.recompute_kv()
            assert engine.in_flight() == at_pause  # (recomputed at the resume: nothing moves yet)
        engine.resume()
        thread.join(timeout=120)
        assert not thread.is_alive()
        return result["out"], at_pause

    # --- lifecycle -------------------------------------------------------------------------------

    def test_sleep_and_wake_keep_generation_unchanged(self, engine, prompts):
        req = request(prompts[1], "z", seed=4, n=2, max_tokens=8)
        before = engine.generate([req])
        engine.sleep()
        engine.wake()
        after = engine.generate([req])
        assert [s.token_ids for s in before[0]] == [s.token_ids for s in after[0]]

    def test_execution_contract_is_json_and_names_engine_sites(self, engine):
        contract = engine.execution_contract()
        text = json.dumps(contract, sort_keys=True)
        assert "engine_prefill" in text and "engine_decode" in text

    def test_close_is_idempotent(self, engine_factory, model_config, prompts):
        engine = engine_factory(model_config, MODEL_SEED)
        assert engine.generate([request(prompts[3], "c", max_tokens=2, seed=0)])[0][0].token_ids
        engine.close()
        engine.close()
