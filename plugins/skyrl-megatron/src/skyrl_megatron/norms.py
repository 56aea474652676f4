"""RMSNorms of the local (non-Transformer-Engine) layer spec that work under sequence parallelism.

megatron-core trains MoE layers under tensor parallelism only with sequence parallelism (the
hidden states between layers are split on the sequence dimension across the tensor-parallel
ranks). Its torch norm wrapper (``WrappedTorchNorm``, used when neither Apex nor Transformer Engine
is installed) refuses sequence parallelism, although a norm needs nothing from it: each token is
normalised on its own. What sequence parallelism does require is that a norm weight applied to a
rank's share of the tokens has its gradient summed over the tensor-parallel ranks; megatron marks
such weights ``sequence_parallel = True`` (its Transformer Engine and Apex norms do), and both
``finalize_model_grads`` (GPU) and ``optimizers.ShardedAdamW`` (CPU) sum the marked gradients.

``SequenceParallelRMSNorm`` builds a plain ``torch.nn.RMSNorm`` (so the op sites claim it like any
other) with that mark; ``with_sequence_parallel_norms`` puts it into a local layer spec.
"""

from __future__ import annotations

import copy
from typing import Any

import torch


def mark_sequence_parallel(weight: torch.nn.Parameter, config: Any) -> None:
    """Mark ``weight`` as megatron's norms mark theirs: its gradient is summed over the
    tensor-parallel ranks when the model runs with sequence parallelism."""
    weight.sequence_parallel = bool(getattr(config, "sequence_parallel", False))


class SequenceParallelRMSNorm:
    """Stands in for ``WrappedTorchNorm`` (RMSNorm only): the same ``torch.nn.RMSNorm``, accepted
    under sequence parallelism, its weight marked (``mark_sequence_parallel``)."""

    def __new__(cls, config: Any, hidden_size: int, eps: float = 1e-5, **_: Any) -> torch.nn.RMSNorm:
        if config.normalization != "RMSNorm":
            raise ValueError(f"normalization {config.normalization!r}: the megatron backend builds RMSNorm models only")
        norm = torch.nn.RMSNorm(normalized_shape=hidden_size, eps=eps)
        mark_sequence_parallel(norm.weight, config)
        return norm


def _is_torch_norm(spec: Any) -> bool:
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    return spec is WrappedTorchNorm


def with_sequence_parallel_norms(layer_spec: Any, num_layers: int) -> Any:
    """``TransformerBlockSubmodules`` of ``num_layers`` copies of a local ``TransformerLayer`` spec
    whose torch norms (input, pre-MLP, q/k, final) are ``SequenceParallelRMSNorm``; other norms
    (Apex) are kept. The modules and parameter names are those megatron builds from the layer spec."""
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules

    spec = copy.deepcopy(layer_spec)
    sub = spec.submodules
    for name in ("input_layernorm", "pre_mlp_layernorm"):
        if _is_torch_norm(getattr(sub, name)):
            setattr(sub, name, SequenceParallelRMSNorm)
    attention = getattr(sub.self_attention, "submodules", None)
    for name in ("q_layernorm", "k_layernorm"):
        if attention is not None and _is_torch_norm(getattr(attention, name, None)):
            setattr(attention, name, SequenceParallelRMSNorm)
    return TransformerBlockSubmodules(layer_specs=[spec] * num_layers, layer_norm=SequenceParallelRMSNorm)
