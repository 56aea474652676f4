"""The shape of a Hugging Face decoder as Megatron sees it: ``GPTLayout`` from a transformers config.

Supported: Llama, Qwen3 dense and Qwen3-MoE (``model_type`` ``llama`` / ``qwen3`` / ``qwen3_moe``),
which Megatron's GPT block expresses exactly: pre-norm RMSNorm, rotary embeddings (non-interleaved),
grouped-query attention (with per-head q/k RMSNorm for Qwen3), SwiGLU MLP or top-k routed SwiGLU
experts (every layer), optional tied embeddings. Everything else is refused with the reason,
rather than converted into a subtly different model.

Light module: no torch, no megatron at import time.
"""

from __future__ import annotations

from typing import Any

import attrs

SUPPORTED_MODEL_TYPES = ("llama", "qwen3", "qwen3_moe")


@attrs.frozen(kw_only=True)
class GPTLayout:
    """Sizes and switches of a decoder, shared by model construction and weight conversion."""

    model_type: str
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    ffn_hidden_size: int
    vocab_size: int
    norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    qk_norm: bool
    tied_embeddings: bool
    # Mixture of experts (0 experts: a dense MLP in every layer).
    num_experts: int = 0
    moe_ffn_hidden_size: int = 0
    moe_top_k: int = 0
    moe_renormalize: bool = False  # top-k probabilities renormalised to sum to 1 (norm_topk_prob)

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @property
    def heads_per_group(self) -> int:
        return self.num_heads // self.num_kv_heads

    def padded_vocab_size(self, tensor_parallel: int) -> int:
        """The vocabulary rounded up to a multiple of ``tensor_parallel`` (Megatron splits rows evenly);
        padding rows are zero and excluded from every softmax."""
        return -(-self.vocab_size // tensor_parallel) * tensor_parallel

    def check_tensor_parallel(self, tensor_parallel: int) -> None:
        sizes = [("num_attention_heads", self.num_heads), ("num_key_value_heads", self.num_kv_heads)]
        sizes.append(("moe_intermediate_size", self.moe_ffn_hidden_size) if self.is_moe else ("intermediate_size", self.ffn_hidden_size))
        for what, size in sizes:
            if size % tensor_parallel:
                raise ValueError(
                    f"tensor_parallel={tensor_parallel} does not divide the model's {what} ({size}); "
                    f"choose a tensor_parallel that divides it"
                )


def _rope_theta(hf_config: Any) -> float:
    params = getattr(hf_config, "rope_parameters", None) or {}
    scaling = getattr(hf_config, "rope_scaling", None) or {}
    rope_type = params.get("rope_type", scaling.get("rope_type", scaling.get("type", "default")))
    if rope_type not in ("default", None):
        raise ValueError(
            f"rope type {rope_type!r} is not supported by the megatron backend; supported: default "
            "(unscaled) rotary embeddings"
        )
    theta = params.get("rope_theta", getattr(hf_config, "rope_theta", None))
    if theta is None:
        raise ValueError("the model config has no rope_theta")
    return float(theta)


def layout_from_hf_config(hf_config: Any) -> GPTLayout:
    """The ``GPTLayout`` of a transformers config, or ``ValueError`` naming what is unsupported."""
    model_type = getattr(hf_config, "model_type", None)
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(
            f"model_type {model_type!r} is not supported by the megatron backend; supported: "
            f"{', '.join(SUPPORTED_MODEL_TYPES)}"
        )
    act = getattr(hf_config, "hidden_act", "silu")
    if act != "silu":
        raise ValueError(f"hidden_act {act!r} is not supported by the megatron backend; supported: silu")
    for flag in ("attention_bias", "mlp_bias"):
        if getattr(hf_config, flag, False):
            raise ValueError(f"{flag}=True is not supported by the megatron backend (bias-free linears only)")
    if model_type.startswith("qwen3") and getattr(hf_config, "use_sliding_window", False):
        raise ValueError("sliding-window attention is not supported by the megatron backend")
    moe: dict[str, Any] = {}
    if model_type == "qwen3_moe":
        if getattr(hf_config, "decoder_sparse_step", 1) != 1 or list(getattr(hf_config, "mlp_only_layers", None) or []):
            raise ValueError(
                "Qwen3-MoE with dense layers between expert layers (decoder_sparse_step != 1 or mlp_only_layers) "
                "is not supported by the megatron backend; supported: experts in every layer"
            )
        moe = dict(
            num_experts=int(hf_config.num_experts),
            moe_ffn_hidden_size=int(hf_config.moe_intermediate_size),
            moe_top_k=int(hf_config.num_experts_per_tok),
            moe_renormalize=bool(hf_config.norm_topk_prob),
        )
    num_heads = int(hf_config.num_attention_heads)
    hidden = int(hf_config.hidden_size)
    head_dim = getattr(hf_config, "head_dim", None) or hidden // num_heads
    return GPTLayout(
        model_type=model_type,
        num_layers=int(hf_config.num_hidden_layers),
        hidden_size=hidden,
        num_heads=num_heads,
        num_kv_heads=int(getattr(hf_config, "num_key_value_heads", None) or num_heads),
        head_dim=int(head_dim),
        ffn_hidden_size=int(hf_config.intermediate_size),
        vocab_size=int(hf_config.vocab_size),
        norm_eps=float(hf_config.rms_norm_eps),
        rope_theta=_rope_theta(hf_config),
        max_position_embeddings=int(hf_config.max_position_embeddings),
        qk_norm=model_type.startswith("qwen3"),
        tied_embeddings=bool(getattr(hf_config, "tie_word_embeddings", False)),
        **moe,
    )
