"""model.dtype chooses the trainer's compute dtype (backend.options.mixed_precision: auto); an
explicit mixed_precision that contradicts it is refused before a run; bf16 trains like fp32."""

import attrs
import pytest
import torch

from skyrl_core.config.loader import structure_config
from skyrl_core.config.schema import ModelConfig, TrainerConfig
from skyrl_core.plugins.manager import get_plugin_manager
from skyrl_core.testing.backend_contract import (
    PROMPT_LENGTHS,
    RESPONSE_LENGTHS,
    TINY_QWEN3,
    make_batch,
    mean_logprob_loss,
    random_sequences,
)
from skyrl_fsdp.backend import FSDPBackend
from skyrl_fsdp.options import FSDPOptions
from skyrl_fsdp.precision import problems

MODEL = ModelConfig(config=dict(TINY_QWEN3))
STEPS = 6


def _config(dtype: str, **fsdp_options):
    return structure_config({
        "model": {"config": dict(TINY_QWEN3), "dtype": dtype},
        "backend": {"name": "fsdp", "options": fsdp_options},
        "environment": "arithmetic",
        "data": {"train": "unused.jsonl"},
    })


@pytest.mark.parametrize(
    ("dtype", "precision", "refused"),
    [("bfloat16", "auto", False), ("bfloat16", "bf16", False), ("float32", "fp32", False), ("float32", "auto", False),
     ("bfloat16", "fp32", True), ("float32", "bf16", True)],
)
def test_preflight_refuses_a_mixed_precision_that_contradicts_model_dtype(dtype, precision, refused):
    cfg = _config(dtype, mixed_precision=precision)
    found = get_plugin_manager().spec("training_backend", "fsdp").preflight_problems(cfg, cfg.backend.options)
    assert found == problems(cfg, cfg.backend.options)
    if not refused:
        assert found == []
        return
    (sentence,) = found
    assert f"backend.options.mixed_precision: {precision!r} contradicts model.dtype: {dtype!r}" in sentence
    assert "leave backend.options.mixed_precision out" in sentence


def _train(dtype: str, batch) -> tuple[list[float], str, torch.dtype]:
    model = attrs.evolve(MODEL, dtype=dtype)
    trainer = TrainerConfig(lr=3e-3, micro_batch_size=2, steps=STEPS)
    with FSDPBackend(model, FSDPOptions(device="cpu"), seed=0, trainer=trainer) as backend:
        precision = backend.execution_contract()["mixed_precision"]
        logprobs_dtype = backend.forward(batch).dtype
        losses = []
        for _ in range(STEPS):
            losses.append(backend.forward_backward(batch, mean_logprob_loss)["loss"])
            backend.optim_step()
        assert all(t.dtype == torch.float32 for _, t in backend.export_weights())  # fp32 master weights
    return losses, precision, logprobs_dtype


def test_bf16_from_model_dtype_reduces_the_loss_like_fp32():
    batch = make_batch(*random_sequences(PROMPT_LENGTHS, RESPONSE_LENGTHS, vocab_size=512))
    fp32, fp32_precision, _ = _train("float32", batch)
    bf16, bf16_precision, logprobs_dtype = _train("bfloat16", batch)
    assert (fp32_precision, bf16_precision) == ("fp32", "bf16")
    assert logprobs_dtype == torch.float32  # logprobs (and the loss on them) stay fp32
    assert bf16 != fp32, "bf16 gave fp32's losses: the compute dtype was not applied"
    # Same start (same seed, up to bf16 rounding of the first forward), same direction every step,
    # and the total decrease within 5% of fp32's.
    assert abs(bf16[0] - fp32[0]) < 0.02 * abs(fp32[0])
    fp32_drop, bf16_drop = fp32[0] - fp32[-1], bf16[0] - bf16[-1]
    assert fp32_drop > 0.5, fp32
    assert abs(bf16_drop - fp32_drop) <= 0.05 * fp32_drop, (fp32, bf16)
    for step in range(1, STEPS):
        assert (bf16[step] < bf16[step - 1]) == (fp32[step] < fp32[step - 1]), (fp32, bf16)
