"""Tiny random models of each supported family, as ``model.config`` dicts (light: no torch)."""

from __future__ import annotations

from typing import Any

_ATTENTION = {
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "intermediate_size": 128,
    "vocab_size": 512,
    "max_position_embeddings": 1024,
    "rms_norm_eps": 1e-6,
}

PRESETS: dict[str, dict[str, Any]] = {
    "qwen3": {"model_type": "qwen3", **_ATTENTION, "tie_word_embeddings": False},
    "llama": {"model_type": "llama", **_ATTENTION, "tie_word_embeddings": True},  # SmolLM2's layout
    "qwen3-moe": {
        "model_type": "qwen3_moe", **_ATTENTION,
        "num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
        "decoder_sparse_step": 1, "norm_topk_prob": True, "tie_word_embeddings": False,
    },
    "qwen3-next": {
        "model_type": "qwen3_next", **_ATTENTION,
        "num_hidden_layers": 2, "layer_types": ["linear_attention", "full_attention"],
        "linear_num_value_heads": 4, "linear_num_key_heads": 2,
        # 64: vLLM-CPU's own GatedDeltaNet kernel (the negative control) takes no 32-channel heads.
        "linear_key_head_dim": 64, "linear_value_head_dim": 64, "linear_conv_kernel_dim": 4,
        "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
        "shared_expert_intermediate_size": 32, "decoder_sparse_step": 1, "norm_topk_prob": True,
        "partial_rotary_factor": 0.25, "tie_word_embeddings": False,
    },
}


def preset(name: str) -> dict[str, Any]:
    """The ``model.config`` dict of preset ``name``."""
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; presets are {', '.join(PRESETS)}")
    return dict(PRESETS[name])
