"""Tiny model configs shared by the tests."""

from skyrl_core.testing.backend_contract import TINY_LLAMA, TINY_QWEN3

TINY_QWEN3_MOE = {
    **TINY_QWEN3,
    "model_type": "qwen3_moe",
    "moe_intermediate_size": 32,
    "num_experts": 4,
    "num_experts_per_tok": 2,
    "norm_topk_prob": True,
    "tie_word_embeddings": False,
}

# The Qwen3-Next hybrid: a GatedDeltaNet layer, then a gated full-attention layer; experts with a
# gated shared expert; partial rotary; (1 + weight) norms.
TINY_QWEN3_NEXT = {
    "model_type": "qwen3_next",
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "layer_types": ["linear_attention", "full_attention"],
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
    "linear_key_head_dim": 16,
    "linear_value_head_dim": 16,
    "linear_conv_kernel_dim": 4,
    "num_experts": 4,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 32,
    "shared_expert_intermediate_size": 32,
    "norm_topk_prob": True,
    "partial_rotary_factor": 0.25,
    "vocab_size": 512,
    "max_position_embeddings": 256,
    "tie_word_embeddings": False,
}

# Qwen3-Next with dense MLPs (layer 0 off the sparse step, layer 1 in mlp_only_layers): its
# GatedDeltaNet and gated attention can be tensor-parallel on CPU (MoE layers cannot).
DENSE_QWEN3_NEXT = {**TINY_QWEN3_NEXT, "decoder_sparse_step": 2, "mlp_only_layers": [1]}

__all__ = ["DENSE_QWEN3_NEXT", "TINY_LLAMA", "TINY_QWEN3", "TINY_QWEN3_MOE", "TINY_QWEN3_NEXT"]


def logprobs_minus_one(logits, token_ids, temperature=1.0):
    """A stand-in for an installed logprobs implementation (IsoExec's canonical one): stock
    log-softmax shifted by -1, so a test can tell which implementation ran."""
    import torch

    logp = torch.log_softmax(logits.float() / temperature, dim=-1)
    return logp.gather(-1, token_ids.long().unsqueeze(-1)).squeeze(-1) - 1.0
