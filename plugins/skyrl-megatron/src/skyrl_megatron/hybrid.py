"""The Qwen3-Next hybrid in megatron-core's modules: a per-layer block spec (GatedDeltaNet or gated
full attention, MoE or dense MLP) and the ``(1 + weight)`` RMSNorm it uses.

megatron-core's own hybrid spec (``get_transformer_block_with_experimental_attention_variant_spec``)
requires Transformer Engine; this one is built from the local (torch) modules, so it runs on CPU:
``ColumnParallelLinear`` / ``RowParallelLinear``, megatron's ``GatedDeltaNet`` (its CPU redirections
in ``cpu_compat``), ``SelfAttention`` with ``attention_output_gate``, ``MoELayer`` with a gated shared
expert. Qwen3-Next's norms scale by ``1 + weight`` (weights stored zero-centred, as transformers
stores them) except the GatedDeltaNet's gated output norm, which is a plain RMSNorm times
``silu(gate)`` (megatron's ``GatedDeltaNet`` applies the gate itself).
"""

from __future__ import annotations

import copy
from typing import Any

import torch

from skyrl_megatron.layout import GPTLayout
from skyrl_megatron.norms import SequenceParallelRMSNorm, mark_sequence_parallel


class UnitOffsetRMSNorm(torch.nn.Module):
    """Qwen3-Next's RMSNorm as transformers computes it: in fp32, ``x * rsqrt(mean(x^2) + eps)``
    scaled by ``1 + weight``, then cast back (weight initialised to zeros)."""

    def __init__(self, config: Any = None, hidden_size: int = 0, eps: float = 1e-6, **_: Any) -> None:
        super().__init__()
        self.eps = float(eps)
        dtype = getattr(config, "params_dtype", torch.float32)
        self.weight = torch.nn.Parameter(torch.zeros(hidden_size, dtype=dtype))
        mark_sequence_parallel(self.weight, config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = x.float()
        out = out * torch.rsqrt(out.pow(2).mean(-1, keepdim=True) + self.eps)
        return (out * (1.0 + self.weight.float())).type_as(x)


def hybrid_config_fields(layout: GPTLayout) -> dict[str, Any]:
    """``TransformerConfig`` fields of the hybrid beyond the GPT ones."""
    return dict(
        attention_output_gate=layout.attention_output_gate,
        linear_conv_kernel_dim=layout.linear_conv_kernel_dim,
        linear_key_head_dim=layout.linear_key_head_dim,
        linear_value_head_dim=layout.linear_value_head_dim,
        linear_num_key_heads=layout.linear_num_key_heads,
        linear_num_value_heads=layout.linear_num_value_heads,
    )


def hybrid_block_spec(layout: GPTLayout) -> Any:
    """``TransformerBlockSubmodules``: per layer, GatedDeltaNet or gated self-attention, MoE or
    dense MLP, every norm a ``UnitOffsetRMSNorm`` but GatedDeltaNet's output norm."""
    from megatron.core.models.gpt import gpt_layer_specs
    from megatron.core.ssm.gated_delta_net import GatedDeltaNet, GatedDeltaNetSubmodules
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.spec_utils import ModuleSpec
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules

    def layer(moe: bool) -> Any:
        spec = gpt_layer_specs.get_gpt_layer_local_spec(
            num_experts=layout.num_experts if moe else None, moe_grouped_gemm=False, qk_layernorm=True, normalization="RMSNorm"
        )
        spec = copy.deepcopy(spec)
        sub = spec.submodules
        sub.input_layernorm = UnitOffsetRMSNorm
        sub.pre_mlp_layernorm = UnitOffsetRMSNorm
        sub.self_attention.submodules.q_layernorm = UnitOffsetRMSNorm
        sub.self_attention.submodules.k_layernorm = UnitOffsetRMSNorm
        return spec

    gdn = ModuleSpec(
        module=GatedDeltaNet,
        submodules=GatedDeltaNetSubmodules(in_proj=ColumnParallelLinear, out_norm=SequenceParallelRMSNorm, out_proj=RowParallelLinear),
    )
    specs = []
    for index in range(layout.num_layers):
        spec = layer(layout.is_moe_layer(index))
        if layout.is_linear_layer(index):
            spec.submodules.self_attention = gdn
        specs.append(spec)
    return TransformerBlockSubmodules(layer_specs=specs, layer_norm=UnitOffsetRMSNorm)
