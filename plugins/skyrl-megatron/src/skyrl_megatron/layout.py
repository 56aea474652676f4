"""The shape of a Hugging Face decoder as Megatron sees it: ``GPTLayout`` from a transformers config.

Supported: Llama, Qwen3 dense, Qwen3-MoE and the Qwen3-Next hybrid (``model_type`` ``llama`` /
``qwen3`` / ``qwen3_moe`` / ``qwen3_next``), which Megatron's GPT block expresses exactly: pre-norm
RMSNorm, rotary embeddings (non-interleaved), grouped-query attention (with per-head q/k RMSNorm for
Qwen3), SwiGLU MLP or top-k routed SwiGLU experts (every layer), optional tied embeddings. Qwen3-Next
adds GatedDeltaNet linear-attention layers between full-attention ones (``layer_types``), an output
gate on full attention, partial rotary embeddings, ``(1 + weight)`` RMSNorms and a gated shared
expert. Everything else is refused with the reason, rather than converted into a subtly different
model.

Light module: no torch, no megatron at import time.
"""

from __future__ import annotations

from typing import Any

import attrs

SUPPORTED_MODEL_TYPES = ("llama", "qwen3", "qwen3_moe", "qwen3_next")


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
    shared_expert_ffn_hidden_size: int = 0  # a shared expert with a sigmoid gate (Qwen3-Next); 0: none
    # Qwen3-Next hybrid: "linear_attention" (GatedDeltaNet) or "full_attention" per layer; empty: all full.
    layer_types: tuple[str, ...] = ()
    dense_layers: tuple[int, ...] = ()  # hybrid: layers with a dense MLP between MoE ones
    linear_num_key_heads: int = 0
    linear_num_value_heads: int = 0
    linear_key_head_dim: int = 0
    linear_value_head_dim: int = 0
    linear_conv_kernel_dim: int = 0
    rotary_percent: float = 1.0
    attention_output_gate: bool = False  # q_proj also yields a per-head sigmoid gate on the attention output
    unit_offset_norms: bool = False  # RMSNorms scale by (1 + weight) (Qwen3-Next)

    @property
    def is_moe(self) -> bool:
        """Whether any layer has experts."""
        return self.num_experts > 0 and len(self.dense_layers) < self.num_layers

    @property
    def is_hybrid(self) -> bool:
        return "linear_attention" in self.layer_types

    def is_moe_layer(self, index: int) -> bool:
        return self.is_moe and index not in self.dense_layers

    def is_linear_layer(self, index: int) -> bool:
        return bool(self.layer_types) and self.layer_types[index] == "linear_attention"

    @property
    def heads_per_group(self) -> int:
        return self.num_heads // self.num_kv_heads

    def padded_vocab_size(self, tensor_parallel: int) -> int:
        """The vocabulary rounded up to a multiple of ``tensor_parallel`` (Megatron splits rows evenly);
        padding rows are zero and excluded from every softmax."""
        return -(-self.vocab_size // tensor_parallel) * tensor_parallel

    def check_tensor_parallel(self, tensor_parallel: int) -> None:
        sizes = [("num_attention_heads", self.num_heads), ("num_key_value_heads", self.num_kv_heads)]
        if self.is_moe:
            sizes.append(("moe_intermediate_size", self.moe_ffn_hidden_size))
        if not self.is_moe or self.dense_layers:
            sizes.append(("intermediate_size", self.ffn_hidden_size))
        if self.shared_expert_ffn_hidden_size:
            sizes.append(("shared_expert_intermediate_size", self.shared_expert_ffn_hidden_size))
        if self.is_hybrid:
            sizes.append(("linear_num_key_heads", self.linear_num_key_heads))
        for what, size in sizes:
            if size % tensor_parallel:
                raise ValueError(
                    f"tensor_parallel={tensor_parallel} does not divide the model's {what} ({size}); "
                    f"choose a tensor_parallel that divides it"
                )


def check_parallel(layout: GPTLayout, *, tensor_parallel: int, expert_parallel: int) -> None:
    """``ValueError`` naming the problem when the model cannot be split this way (read by the
    backend's pre-flight check and by model construction, so a run is refused before any work).
    MoE layers under tensor parallelism run with sequence parallelism (``model.build_gpt_model``)."""
    layout.check_tensor_parallel(tensor_parallel)
    if expert_parallel > 1 and not layout.is_moe:
        raise ValueError(f"expert_parallel={expert_parallel} needs a mixture-of-experts model; {layout.model_type} has no experts")
    if layout.is_moe and layout.num_experts % expert_parallel:
        raise ValueError(f"expert_parallel={expert_parallel} does not divide the model's num_experts ({layout.num_experts})")


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
    if model_type in ("qwen3_moe", "qwen3_next"):
        dense_layers = _dense_layers(hf_config)
        if model_type == "qwen3_moe" and dense_layers:
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
    if model_type == "qwen3_next":
        moe.update(_qwen3_next_fields(hf_config), dense_layers=dense_layers)
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


def _dense_layers(hf_config: Any) -> tuple[int, ...]:
    """Layers transformers gives a dense MLP: in ``mlp_only_layers`` or off the sparse step."""
    step = int(getattr(hf_config, "decoder_sparse_step", 1) or 1)
    only = set(getattr(hf_config, "mlp_only_layers", None) or [])
    return tuple(i for i in range(int(hf_config.num_hidden_layers)) if i in only or (i + 1) % step)


def _qwen3_next_fields(hf_config: Any) -> dict[str, Any]:
    """The hybrid's fields: layer pattern, GatedDeltaNet sizes, gated attention, partial rotary,
    ``(1 + weight)`` norms, the gated shared expert."""
    layer_types = tuple(hf_config.layer_types)
    unknown = sorted(set(layer_types) - {"linear_attention", "full_attention"})
    if unknown:
        raise ValueError(f"layer_types {unknown} are not supported by the megatron backend; supported: linear_attention, full_attention")
    key_heads, value_heads = int(hf_config.linear_num_key_heads), int(hf_config.linear_num_value_heads)
    if value_heads % key_heads:
        raise ValueError(f"linear_num_value_heads ({value_heads}) must be a multiple of linear_num_key_heads ({key_heads})")
    shared = int(getattr(hf_config, "shared_expert_intermediate_size", 0) or 0)
    if not shared:
        raise ValueError("Qwen3-Next without a shared expert (shared_expert_intermediate_size=0) is not supported by the megatron backend")
    return dict(
        layer_types=layer_types,
        linear_num_key_heads=key_heads,
        linear_num_value_heads=value_heads,
        linear_key_head_dim=int(hf_config.linear_key_head_dim),
        linear_value_head_dim=int(hf_config.linear_value_head_dim),
        linear_conv_kernel_dim=int(hf_config.linear_conv_kernel_dim),
        rotary_percent=float(getattr(hf_config, "partial_rotary_factor", 1.0)),
        attention_output_gate=True,
        unit_offset_norms=True,
        shared_expert_ffn_hidden_size=shared,
    )
