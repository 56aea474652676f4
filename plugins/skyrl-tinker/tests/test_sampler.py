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
