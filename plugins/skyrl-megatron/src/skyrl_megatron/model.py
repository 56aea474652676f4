"""Building Megatron's ``GPTModel`` for a ``GPTLayout``, and running it on TrainingBatch rows."""

from __future__ import annotations

from typing import Mapping

import torch

from skyrl_megatron.layout import GPTLayout, check_parallel


def transformer_engine_available() -> bool:
    try:
        import transformer_engine  # noqa: F401
    except ImportError:
        return False
    return True


def build_gpt_model(
    layout: GPTLayout, *, tensor_parallel: int, params_dtype: torch.dtype, use_transformer_engine: bool, on_cpu: bool
) -> torch.nn.Module:
    """A ``GPTModel`` with parallel (vocabulary-split) output, on the CPU or the current CUDA device;
    its random weights are replaced right after. Call after ``parallel_state.initialize_model_parallel``."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt import gpt_layer_specs
    from megatron.core.transformer.transformer_config import TransformerConfig

    check_parallel(layout, tensor_parallel=tensor_parallel, expert_parallel=1)
    moe: dict = {}
    if layout.is_moe:
        moe = dict(
            # MoE under tensor parallelism requires sequence parallelism in megatron-core.
            sequence_parallel=tensor_parallel > 1,
            num_moe_experts=layout.num_experts,
            moe_ffn_hidden_size=layout.moe_ffn_hidden_size,
            moe_router_topk=layout.moe_top_k,
            # Qwen3-MoE: softmax over all experts, then top-k (renormalised when norm_topk_prob).
            # Megatron's default (softmax over the top-k logits) is that renormalised form.
            moe_router_pre_softmax=not layout.moe_renormalize,
            moe_router_score_function="softmax",
            moe_router_dtype="fp32",
            moe_router_load_balancing_type="none",
            moe_aux_loss_coeff=0.0,
            moe_grouped_gemm=False,
            # The all-to-all dispatcher allocates CUDA streams when built; all-gather runs on CPU.
            moe_token_dispatcher_type="allgather" if on_cpu else "alltoall",
        )
        if layout.shared_expert_ffn_hidden_size:
            moe.update(moe_shared_expert_intermediate_size=layout.shared_expert_ffn_hidden_size, moe_shared_expert_gate=True)
    if layout.model_type == "qwen3_next":
        from skyrl_megatron.hybrid import hybrid_config_fields

        moe.update(hybrid_config_fields(layout))
    config = TransformerConfig(
        num_layers=layout.num_layers,
        hidden_size=layout.hidden_size,
        num_attention_heads=layout.num_heads,
        num_query_groups=layout.num_kv_heads,
        kv_channels=layout.head_dim,
        ffn_hidden_size=layout.ffn_hidden_size,
        normalization="RMSNorm",
        layernorm_epsilon=layout.norm_eps,
        qk_layernorm=layout.qk_norm,
        gated_linear_unit=True,
        activation_func=torch.nn.functional.silu,
        add_bias_linear=False,
        add_qkv_bias=False,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        attention_softmax_in_fp32=True,
        tensor_model_parallel_size=tensor_parallel,
        # megatron-core's default "full" is deprecated (it warns, then uses []): the same, said directly.
        cuda_graph_scope=[],
        params_dtype=params_dtype,
        bf16=params_dtype == torch.bfloat16,
        use_cpu_initialization=on_cpu,
        # Megatron marks tensor-parallel weights (``tensor_model_parallel``, which gradient-norm
        # code reads) only inside its initialisers, so they must run even though weights are loaded.
        perform_initialization=True,
        # Gradients of data-parallel replicas are summed, not averaged (megatron's DDP wrapper
        # reads this): each replica's loss is already its share of the whole batch's loss.
        calculate_per_token_loss=True,
        **moe,
    )
    if layout.model_type == "qwen3_next":
        from skyrl_megatron.hybrid import hybrid_block_spec

        # Local modules on GPU too: megatron's own hybrid spec needs Transformer Engine and its norms
        # cannot scale by (1 + weight) the way transformers stores Qwen3-Next's weights.
        spec = hybrid_block_spec(layout)
    elif use_transformer_engine:
        spec = gpt_layer_specs.get_gpt_layer_with_transformer_engine_spec(
            num_experts=layout.num_experts or None, moe_grouped_gemm=False, qk_layernorm=layout.qk_norm
        )
    else:
        from skyrl_megatron.norms import with_sequence_parallel_norms

        # megatron's torch norm wrapper refuses sequence parallelism (which MoE under tensor
        # parallelism needs); the same torch RMSNorm, with its weight marked, does not.
        spec = with_sequence_parallel_norms(
            gpt_layer_specs.get_gpt_layer_local_spec(
                num_experts=layout.num_experts or None, moe_grouped_gemm=False, qk_layernorm=layout.qk_norm, normalization="RMSNorm"
            ),
            layout.num_layers,
        )
    return GPTModel(
        config=config,
        transformer_layer_spec=spec,
        vocab_size=layout.padded_vocab_size(tensor_parallel),
        max_sequence_length=layout.max_position_embeddings,
        parallel_output=True,
        share_embeddings_and_output_weights=layout.tied_embeddings,
        position_embedding_type="rope",
        rotary_percent=layout.rotary_percent,
        rotary_base=layout.rope_theta,
    )


def load_parameters(model: torch.nn.Module, weights: Mapping[str, torch.Tensor]) -> None:
    """Copy ``weights`` into ``model``'s parameters; every parameter must be given, and nothing else."""
    params = dict(model.named_parameters())
    missing = sorted(set(params) - set(weights))
    unexpected = sorted(set(weights) - set(params))
    if missing or unexpected:
        raise ValueError(f"weights do not match the Megatron model: missing {missing}, unexpected {unexpected}")
    with torch.no_grad():
        for name, param in params.items():
            value = weights[name]
            if value.shape != param.shape:
                raise ValueError(f"{name}: weight of shape {tuple(value.shape)} for a parameter of {tuple(param.shape)}")
            param.copy_(value)


def left_align(input_ids: torch.Tensor, attention_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows moved so their real tokens start at position 0, and each row's shift.

    Megatron's rotary embedding numbers positions 0..S-1 whatever ``position_ids`` say, so left
    padding would shift every position. A TrainingBatch row is ``pads, prompt, response, pads``;
    rotated left by its number of leading pads it becomes ``prompt, response, pads``: positions count
    real tokens only, and a plain causal mask keeps the trailing pads out of every real token's view.
    """
    prompt_pads = (attention_mask.cumsum(dim=1) == 0).sum(dim=1)  # leading zeros of each row
    length = input_ids.shape[1]
    index = (torch.arange(length, device=input_ids.device).unsqueeze(0) + prompt_pads.unsqueeze(1)) % length
    return input_ids.gather(1, index), prompt_pads
