"""Op-site forward of transformers' GatedDeltaNet (Qwen3-Next linear attention): the module's own
projections, norms and cache bookkeeping, with the causal conv and the delta rule as the ops
``gdn_conv`` and ``gdn_core`` (calling conventions in ``skyrl_core.ops.hf``)."""

from __future__ import annotations

import sys
from typing import Any


def gdn_forward(module: Any, hidden_states: Any, cache_params: Any = None, attention_mask: Any = None, **kwargs: Any) -> Any:
    dispatch = module._skyrl_dispatch
    conv_fn, core_fn = dispatch.resolve("gdn_conv", module), dispatch.resolve("gdn_core", module)
    if conv_fn is None and core_fn is None:
        return module._skyrl_stock_forward(hidden_states, cache_params=cache_params, attention_mask=attention_mask, **kwargs)
    if conv_fn is None or core_fn is None:
        raise ValueError("gdn_conv and gdn_core must be both stock or both non-stock at one site")
    modeling = sys.modules[type(module).__module__]
    hidden_states = modeling.apply_mask_to_padding_states(hidden_states, attention_mask)
    batch, steps = hidden_states.shape[:2]
    query, key, value, z, b, a = module.fix_query_key_value_ordering(
        module.in_proj_qkvz(hidden_states), module.in_proj_ba(hidden_states)
    )
    mixed = torch_cat([x.reshape(batch, steps, -1) for x in (query, key, value)])

    previous = False
    layer = None
    if cache_params is not None:
        layer = cache_params.layers[module.layer_idx]
        if getattr(layer, "record_past", False):
            raise ValueError("GatedDeltaNet with past-state recording is not supported by a non-stock implementation")
        previous = cache_params.has_previous_state(module.layer_idx)
    width = module.conv_kernel_size
    conv_state = layer.conv_states[0][..., -(width - 1) :] if previous else None
    conv_out, _ = conv_fn(mixed, module.conv1d.weight.squeeze(1), module.conv1d.bias, conv_state)
    dispatch.emit("gdn_conv", module, conv_out)
    if cache_params is not None:
        cache_params.update_conv_state(mixed.transpose(1, 2), module.layer_idx, conv_kernel_size=width)

    query, key, value = conv_out.split([module.key_dim, module.key_dim, module.value_dim], dim=-1)
    query = query.reshape(batch, steps, -1, module.head_k_dim)
    key = key.reshape(batch, steps, -1, module.head_k_dim)
    value = value.reshape(batch, steps, -1, module.head_v_dim)
    state = layer.recurrent_states[0] if previous else None
    core_out, state = core_fn(query, key, value, a, b, module.A_log, module.dt_bias, state)
    dispatch.emit("gdn_core", module, core_out)
    if cache_params is not None:
        cache_params.update_recurrent_state(state, module.layer_idx)

    normed = module.norm(core_out.reshape(-1, core_out.shape[-1]), z.reshape(-1, z.shape[-1]))
    return module.out_proj(normed.reshape(batch, steps, -1))


def torch_cat(parts: list[Any]) -> Any:
    import torch

    return torch.cat(parts, dim=-1)
