"""The sampler's engine resting while the trainer works (skyrl-torch sleep/wake) changes no sample."""

import torch

from skyrl_core.types import GenerationRequest, SamplingParams
from skyrl_tinker.sampler import Sampler, build_engine
from skyrl_tinker.trainer import LoraTrainer


def test_a_rested_engine_samples_the_new_weights_exactly_like_one_that_stayed_awake(tiny_model):
    trainer = LoraTrainer(tiny_model)
    trainer.create("a", rank=4, alpha=32.0, groups=("attn", "mlp"), seed=1)
    for p in trainer.adapters["a"].optimizer.param_groups[0]["params"]:
        p.data.add_(0.05 * torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())))
    adapter = trainer.adapter_tensors("a")
    requests = [GenerationRequest(request_id="r", prompt_token_ids=(10, 11, 12), sampling=SamplingParams(max_tokens=6, n=3, seed=5))]

    def samples(sampler: Sampler) -> list:
        return [(s.token_ids, torch.tensor(s.logprobs).view(torch.int32).tolist()) for s in sampler.engine.generate(requests)[0]]

    awake = Sampler(build_engine("torch", tiny_model), rests=True)
    resting = Sampler(build_engine("torch", tiny_model), rests=True)
    base = samples(resting)
    assert samples(awake) == base
    resting.rest()
    assert not resting.awake and resting.engine._cache is None  # its KV cache was given back
    for sampler in (awake, resting):
        sampler.load("adapter-a", adapter, trainer.base_weights())
        sampler.ready()
    assert resting.awake
    adapted = samples(awake)
    assert samples(resting) == adapted and adapted != base  # (negative control: the adapter shows)
    awake.close()
    resting.close()


def test_a_load_that_fails_midway_leaves_no_key_and_the_next_load_sets_every_weight_it_touched(tiny_model):
    """A load that raises after some modules were copied in leaves the engine holding a mix: the
    same key loaded again must redo it (not return early), and the base model must come back
    whole, including modules only the failed adapter touched."""
    from skyrl_core import lora

    trainer = LoraTrainer(tiny_model)
    trainer.create("a", rank=4, alpha=32.0, groups=("attn",), seed=1)
    trainer.create("b", rank=4, alpha=32.0, groups=("attn", "mlp"), seed=2)
    for name in ("a", "b"):
        for p in trainer.adapters[name].optimizer.param_groups[0]["params"]:
            p.data.add_(0.05 * torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())))
    base = trainer.base_weights()
    a, b = trainer.adapter_tensors("a"), trainer.adapter_tensors("b")
    last = [k for k in b if k.endswith(".lora_A")][-1]
    broken = {**b, last: torch.zeros(3, 5)}  # the last module's merge fails after the others were copied
    assert any(".mlp." in n for n in lora.adapted_weight_names(broken)[:-1])  # (it touched modules "a" lacks)

    def bits(sampler: Sampler) -> dict[str, list]:
        return {n: p.detach().view(torch.int32).flatten().tolist() for n, p in sampler.engine._params.items()}

    sampler = Sampler(build_engine("torch", tiny_model))
    base_bits = bits(sampler)
    sampler.load("a", a, base)
    a_bits = bits(sampler)
    assert a_bits != base_bits
    try:
        sampler.load("b", broken, base)
    except RuntimeError:
        pass
    else:
        raise AssertionError("the broken adapter loaded")
    assert bits(sampler) != a_bits  # (the failure left a mix: the checks below are not vacuous)
    sampler.load("a", a, base)
    assert bits(sampler) == a_bits
    try:
        sampler.load("b", broken, base)
    except RuntimeError:
        pass
    sampler.load(None, None, base)
    assert bits(sampler) == base_bits
    sampler.close()


def test_a_small_load_runs_on_one_thread_and_gives_the_caller_its_threads_back(tiny_model, monkeypatch):
    """Merging a tiny adapter in runs on one thread (a parallel region would only wait for the
    second core); above ``ONE_THREAD_BELOW_ELEMENTS`` (the negative control) it keeps the caller's."""
    from skyrl_tinker import sampler as sampler_module

    trainer = LoraTrainer(tiny_model)
    trainer.create("a", rank=4, alpha=32.0, groups=("attn", "mlp"), seed=1)
    seen: list[int] = []

    class RecordingEngine:
        def update_weights(self, named):
            seen.append(torch.get_num_threads())
            list(named)

    previous = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        sampler = Sampler(RecordingEngine())
        sampler.load("a", trainer.adapter_tensors("a"), trainer.base_weights())
        assert seen == [1] and torch.get_num_threads() == 2
        monkeypatch.setattr(sampler_module, "ONE_THREAD_BELOW_ELEMENTS", 1)
        sampler.load(None, None, trainer.base_weights())  # (restoring the base: the same rule)
        assert seen == [1, 2] and torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(previous)
