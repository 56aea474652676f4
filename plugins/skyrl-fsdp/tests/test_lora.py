"""``backend.options.lora``: an adapter trained on frozen base weights, exported merged, resumed exactly."""

import pytest
import torch

from skyrl_core.config.schema import ModelConfig, TrainerConfig
from skyrl_core.testing.backend_contract import (
    PROMPT_LENGTHS,
    RESPONSE_LENGTHS,
    TINY_QWEN3,
    assert_weights_bitwise_equal,
    bits,
    hf_model_with,
    make_batch,
    mean_logprob_loss,
    random_sequences,
    reference_logprobs,
)
from skyrl_fsdp.backend import FSDPBackend
from skyrl_fsdp.options import FSDPOptions, LoraOptions

MODEL = ModelConfig(config=dict(TINY_QWEN3))
LORA = {"rank": 4, "alpha": 8.0, "targets": ["attn", "mlp"]}


def backend(lora=LORA):
    options = FSDPOptions(device="cpu", lora=None if lora is None else LoraOptions(**lora))
    return FSDPBackend(MODEL, options, trainer=TrainerConfig(lr=1e-2, micro_batch_size=2))


def test_lora_trains_the_adapter_only_and_exports_merged_hf_weights(tmp_path):
    prompts, responses = random_sequences(PROMPT_LENGTHS, RESPONSE_LENGTHS, vocab_size=512)
    batch = make_batch(prompts, responses)
    with backend(None) as full:
        base = dict(full.export_weights())
    with backend() as fsdp:
        before = dict(fsdp.export_weights())
        assert_weights_bitwise_equal(before, base)  # B starts at zero: the merged model is the base model
        fsdp.forward_backward(batch, mean_logprob_loss)
        fsdp.optim_step()
        after = dict(fsdp.export_weights())
        assert list(after) == list(base)  # plain Hugging Face names, no adapter tensors
        changed = {n for n in after if not torch.equal(bits(after[n]), bits(base[n]))}
        adapted = {n for n in base if n.rsplit(".", 2)[-2] in ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")}
        assert changed == adapted  # embeddings and norms are frozen; every adapted layer moved
        # What is exported is what the backend computes: a plain model with these weights agrees.
        assert (fsdp.forward(batch) - reference_logprobs(hf_model_with(MODEL, after), prompts, responses)).abs().max() < 1e-5

        fsdp.save_checkpoint(str(tmp_path / "ck"))
        fsdp.forward_backward(batch, mean_logprob_loss)
        fsdp.optim_step()
        continued = dict(fsdp.export_weights())
    with backend() as resumed:
        resumed.load_checkpoint(str(tmp_path / "ck"))
        assert_weights_bitwise_equal(dict(resumed.export_weights()), after)
        resumed.forward_backward(batch, mean_logprob_loss)
        resumed.optim_step()
        assert_weights_bitwise_equal(dict(resumed.export_weights()), continued)  # adapter and AdamW state restored


@pytest.mark.parametrize(
    "lora, message",
    [
        ({"rank": 0}, "rank must be an integer >= 1"),
        ({"rank": 4, "alpha": 0}, "alpha must be a number > 0"),
        ({"rank": 4, "targets": ["attn", "experts"]}, "targets must be a non-empty list of attn, mlp, unembed"),
    ],
)
def test_bad_lora_options_are_refused_by_key_path(lora, message):
    from skyrl_core.config.loader import structure_options
    from skyrl_core.config.errors import ConfigError
    from skyrl_core.plugins.manager import get_plugin_manager

    spec = get_plugin_manager().spec("training_backend", "fsdp")
    with pytest.raises(ConfigError, match=message) as info:
        structure_options(spec, {"lora": lora}, path="backend.options")
    assert "backend.options.lora" in str(info.value)


def test_lora_on_a_tied_unembedding_is_refused():
    with pytest.raises(ValueError, match="ties lm_head to embed_tokens"):
        backend({"rank": 4, "targets": ["unembed"]})
