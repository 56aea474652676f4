"""LoRA in the Megatron backend over two processes (Ray actors, gloo on loopback): tensor parallel 2
and data parallel 2 train the adapter one process trains, and export it whole."""

import pytest
import torch

from skyrl_core.config.schema import ModelConfig, TrainerConfig
from skyrl_core.lora_options import LoraOptions
from skyrl_core.testing.backend_contract import (
    PROMPT_LENGTHS,
    RESPONSE_LENGTHS,
    assert_weights_bitwise_equal,
    make_batch,
    mean_logprob_loss,
    random_sequences,
)
from skyrl_core.types import OptimizerHyperparams
from skyrl_megatron.backend import MegatronBackend
from skyrl_megatron.options import MegatronOptions

from megatron_test_models import TINY_LLAMA, TINY_QWEN3

pytestmark = pytest.mark.slow

STEP = OptimizerHyperparams(lr=2e-2, betas=(0.8, 0.95), eps=1e-7, weight_decay=0.1, grad_clip=0.5)


def lora_run(model: dict, lora: dict, batch, **layout) -> tuple[dict, list[float], dict, dict, torch.Tensor]:
    """(initial adapter, grad norms of two steps, trained adapter, merged HF weights, logprobs after)."""
    options = MegatronOptions(device="cpu", lora=LoraOptions(**lora), **layout)
    with MegatronBackend(ModelConfig(config=dict(model)), options, seed=5, trainer=TrainerConfig(micro_batch_size=2)) as backend:
        start = backend.export_adapter()
        norms = []
        for _ in range(2):
            backend.forward_backward(batch, mean_logprob_loss)
            norms.append(backend.optim_step(STEP)["grad_norm"])
        return start, norms, backend.export_adapter(), dict(backend.export_weights()), backend.forward(batch)


@pytest.mark.parametrize(
    "model, lora, layout",
    [
        (TINY_QWEN3, {"rank": 4, "alpha": 8.0, "targets": ["attn", "mlp"]}, {"tensor_parallel": 2}),
        (TINY_LLAMA, {"rank": 4, "alpha": 8.0, "targets": ["attn", "mlp", "unembed"]}, {"tensor_parallel": 2}),
        (TINY_QWEN3, {"rank": 4, "alpha": 8.0, "targets": ["attn", "mlp"]}, {"world_size": 2}),
    ],
    ids=["qwen3-tp2", "llama-unembed-tp2", "qwen3-dp2"],
)
def test_two_processes_train_the_adapter_one_process_trains(ray_session, model, lora, layout):
    """Every share of A and B (column-parallel B rows, row-parallel A columns, the padded
    vocabulary's B) is gathered back into peft's whole tensors: the initial adapter is one
    process's bit for bit; after two steps the gradient norms and the adapter agree to rounding (a
    gradient of A not summed across ranks, or a share put back in the wrong place, fails this)."""
    batch = make_batch(*random_sequences(PROMPT_LENGTHS + (4,), RESPONSE_LENGTHS + (3,), vocab_size=512))
    start_1, norms_1, trained_1, weights_1, logprobs_1 = lora_run(model, lora, batch)
    start_2, norms_2, trained_2, weights_2, logprobs_2 = lora_run(model, lora, batch, **layout)
    assert_weights_bitwise_equal(start_2, start_1)
    assert norms_2 == pytest.approx(norms_1, rel=1e-4)
    assert trained_2.keys() == trained_1.keys()
    for key, value in trained_1.items():
        assert not torch.equal(value, start_1[key])  # every A and B moved
        torch.testing.assert_close(trained_2[key], value, rtol=1e-3, atol=1e-3)  # (Adam: see test_lora.py)
    assert weights_2.keys() == weights_1.keys()
    assert (logprobs_2 - logprobs_1).abs().max().item() <= 1e-3
