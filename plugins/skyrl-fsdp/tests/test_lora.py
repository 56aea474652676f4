"""``backend.options.lora``: an adapter trained on frozen base weights, exported merged, resumed exactly."""

import pytest

from skyrl_core.config.schema import ModelConfig, TrainerConfig
from skyrl_core.testing.backend_contract import TINY_QWEN3
from skyrl_core.testing.lora_contract import check_lora_trains_alone_exports_merged_and_resumes
from skyrl_fsdp.backend import FSDPBackend
from skyrl_fsdp.options import FSDPOptions, LoraOptions

MODEL = ModelConfig(config=dict(TINY_QWEN3))
LORA = {"rank": 4, "alpha": 8.0, "targets": ["attn", "mlp"]}


def backend(lora=LORA):
    options = FSDPOptions(device="cpu", lora=None if lora is None else LoraOptions(**lora))
    return FSDPBackend(MODEL, options, trainer=TrainerConfig(lr=1e-2, micro_batch_size=2))


def test_lora_trains_the_adapter_only_and_exports_merged_hf_weights(tmp_path):
    check_lora_trains_alone_exports_merged_and_resumes(lambda lora: backend(LORA if lora else None), MODEL, tmp_path)


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
