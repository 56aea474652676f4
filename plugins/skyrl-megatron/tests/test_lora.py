"""``backend.options.lora`` in the Megatron backend: the adapter peft would train, on frozen base
weights, exported under peft's names and merged, resumed exactly, and step for step what the FSDP
backend's LoRA computes from the same seed."""

import pytest
import torch

from skyrl_core.config.schema import ModelConfig, TrainerConfig
from skyrl_core.lora_options import LoraOptions
from skyrl_core.testing.backend_contract import (
    PROMPT_LENGTHS,
    RESPONSE_LENGTHS,
    TINY_LLAMA,
    TINY_QWEN3,
    assert_weights_bitwise_equal,
    make_batch,
    mean_logprob_loss,
    random_sequences,
)
from skyrl_core.testing.lora_contract import check_lora_trains_alone_exports_merged_and_resumes
from skyrl_core.types import OptimizerHyperparams
from skyrl_megatron.backend import MegatronBackend
from skyrl_megatron.options import MegatronOptions

from megatron_test_models import TINY_QWEN3_MOE

MODEL = ModelConfig(config=dict(TINY_QWEN3))
LORA = {"rank": 4, "alpha": 8.0, "targets": ["attn", "mlp"]}


def megatron(lora=LORA, model=MODEL, seed=0):
    options = MegatronOptions(device="cpu", lora=None if lora is None else LoraOptions(**lora))
    return MegatronBackend(model, options, seed=seed, trainer=TrainerConfig(lr=1e-2, micro_batch_size=2))


@pytest.fixture(scope="module")
def batch_parts():
    return random_sequences(PROMPT_LENGTHS, RESPONSE_LENGTHS, vocab_size=512)


def test_lora_trains_the_adapter_only_and_exports_merged_hf_weights(tmp_path):
    check_lora_trains_alone_exports_merged_and_resumes(lambda lora: megatron(LORA if lora else None), MODEL, tmp_path)


@pytest.mark.parametrize("config", [TINY_QWEN3, TINY_LLAMA], ids=["qwen3", "llama"])
def test_the_adapter_and_its_steps_are_the_fsdp_backends_from_the_same_seed(batch_parts, config):
    """Fused q/k/v and gate/up linears train exactly the adapters peft puts on each projection:
    same initial A and B (bits), the same gradient norms, and after two AdamW steps with the
    caller's hyperparameters, the same adapter to float rounding. A wrong row layout of the fused delta fails this."""
    from skyrl_fsdp.backend import FSDPBackend
    from skyrl_fsdp.options import FSDPOptions

    model = ModelConfig(config=dict(config))
    batch = make_batch(*batch_parts)
    lora = {**LORA, "targets": ["attn", "mlp"] + (["unembed"] if not config["tie_word_embeddings"] else [])}
    step = OptimizerHyperparams(lr=2e-2, betas=(0.8, 0.95), eps=1e-7, weight_decay=0.1, grad_clip=0.5)
    exported = []
    with megatron(lora, model=model, seed=5) as m:
        fsdp = FSDPBackend(model, FSDPOptions(device="cpu", lora=LoraOptions(**lora)), seed=5,
                           trainer=TrainerConfig(lr=1e-2, micro_batch_size=2))
        with fsdp:
            start_m = m.export_adapter()
            start_f = {k: v.clone() for k, v in fsdp.export_adapter().items()}
            assert start_m.keys() == start_f.keys()
            assert_weights_bitwise_equal(start_m, start_f)
            norms = []
            for _ in range(2):
                for backend in (m, fsdp):
                    backend.forward_backward(batch, mean_logprob_loss)
                norms.append([b.optim_step(step)["grad_norm"] for b in (m, fsdp)])
            exported = [m.export_adapter(), fsdp.export_adapter()]
    for a, b in norms:
        assert a == pytest.approx(b, rel=1e-4)
    moved = 0
    for key, value in exported[1].items():
        # Adam divides by sqrt(v): a gradient entry near zero turns float rounding into up to a
        # few per mille of one step (lr 2e-2); a wrong layout moves entries by whole steps.
        torch.testing.assert_close(exported[0][key], value, rtol=1e-3, atol=1e-3)
        moved += not torch.equal(value, start_f[key])
    assert moved == len(start_f)  # every A and B moved (B from zero)


def test_optim_step_takes_the_callers_hyperparameters(batch_parts):
    """A step with lr 0 changes nothing; clip and lr given per call reach the update."""
    batch = make_batch(*batch_parts)
    with megatron() as backend:
        before = backend.export_adapter()
        backend.forward_backward(batch, mean_logprob_loss)
        result = backend.optim_step(OptimizerHyperparams(lr=0.0))
        assert result["lr"] == 0.0 and result["grad_norm"] > 0
        assert_weights_bitwise_equal(backend.export_adapter(), before)
        backend.forward_backward(batch, mean_logprob_loss)
        backend.optim_step(OptimizerHyperparams(lr=1e-2))
        assert any(not torch.equal(v, before[k]) for k, v in backend.export_adapter().items())


@pytest.mark.parametrize(
    "options, model, message",
    [
        ({}, TINY_QWEN3_MOE, "covers dense Llama and Qwen3 models; this model is 'qwen3_moe'"),
        ({"lora": {"rank": 4, "targets": ["unembed"]}}, TINY_QWEN3, "ties lm_head to embed_tokens"),
    ],
)
def test_what_lora_here_does_not_cover_is_refused(options, model, message):
    options = {"device": "cpu", "lora": LoraOptions(**options.pop("lora", LORA)), **options}
    with pytest.raises(ValueError, match=message):
        MegatronBackend(ModelConfig(config=dict(model)), MegatronOptions(**options))


def test_export_adapter_without_lora_is_refused():
    with megatron(None) as backend, pytest.raises(ValueError, match="trains no LoRA adapter"):
        backend.export_adapter()


def test_lora_options_are_validated_by_key_path():
    from skyrl_core.config.errors import ConfigError
    from skyrl_core.config.loader import structure_options
    from skyrl_core.plugins.manager import get_plugin_manager

    spec = get_plugin_manager().spec("training_backend", "megatron")
    with pytest.raises(ConfigError, match="targets must be a non-empty list") as info:
        structure_options(spec, {"lora": {"rank": 4, "targets": ["experts"]}}, path="backend.options")
    assert "backend.options.lora" in str(info.value)
    assert structure_options(spec, {"lora": {"rank": 4}, "tensor_parallel": 2}, path="backend.options").lora.rank == 4


@pytest.mark.parametrize(
    "lora, message",
    [
        ({"rank": 0}, "rank must be an integer >= 1"),
        ({"rank": 4, "bogus": 1}, "LoraOptions: unknown key 'bogus'; allowed: rank, alpha, targets"),
        ("yes", "MegatronOptions.lora must be a mapping of LoraOptions options or null"),
    ],
)
def test_lora_given_in_python_is_checked_like_config(lora, message):
    """``MegatronOptions(lora={...})`` from Python: the mapping becomes LoraOptions, checked; it was
    kept as a raw dict (a rank of 0 or any value passed until the backend used it)."""
    with pytest.raises(ValueError, match=message):
        MegatronOptions(lora=lora)
    assert MegatronOptions(lora={"rank": 4}).lora == LoraOptions(rank=4)
