"""Op site of megatron-core's ``GatedDeltaNet``: the causal conv and the gated delta rule as the ops
``gdn_conv`` and ``gdn_core`` (calling conventions in ``skyrl_core.ops.hf``), mirroring
``skyrl_core.ops.hf_gdn`` for transformers' Qwen3-Next layer.

With the stock implementations installed the layer's own forward runs. With non-stock ones: the
(patched) ``in_proj`` gives this rank's ``[q, k, v, z, b, a]`` columns, the conv op runs on the
rank's ``[q, k, v]`` channels (a depthwise conv: each channel on its own), the core op on the
rank's heads (each value head with its key head, on its own), the output norm as ``rms_norm`` with
``z`` as its gate, then the (patched) ``out_proj``. No op mixes heads or channels, so the bits do
not depend on the tensor-parallel degree. Training rows are whole sequences from position 0
(``model.left_align``): no conv or recurrent state is carried in.
"""

from __future__ import annotations

from typing import Any


def gdn_forward(module: Any, hidden_states: Any, attention_mask: Any = None, *args: Any, **kwargs: Any) -> Any:
    dispatch = module._skyrl_dispatch
    conv_fn, core_fn = dispatch.resolve("gdn_conv", module), dispatch.resolve("gdn_core", module)
    if conv_fn is None and core_fn is None:
        return module._skyrl_stock_forward(hidden_states, attention_mask, *args, **kwargs)
    if conv_fn is None or core_fn is None:
        raise ValueError("gdn_conv and gdn_core must be both stock or both non-stock at one site")
    if args or any(kwargs.get(k) is not None for k in ("inference_context", "inference_params", "packed_seq_params", "key_value_states")):
        raise NotImplementedError(f"{module._skyrl_name}: inference contexts / packed sequences with a non-stock GatedDeltaNet")
    norm = dispatch.resolve("rms_norm", module.out_norm)
    if norm is None:
        raise ValueError("rms_norm must be non-stock where gdn_conv/gdn_core are (the gated output norm computes it)")
    tp = module.tp_size
    # Under sequence parallelism in_proj gathers the ranks' sequence shares and out_proj scatters
    # them back: everything between sees the whole sequence.
    projected, _ = module.in_proj(hidden_states)
    steps, batch, _ = projected.shape
    projected = projected.transpose(0, 1)  # [B, S, local]
    qk, v = module.qk_dim // tp, module.v_dim // tp
    heads = module.num_value_heads // tp
    mixed, z, b, a = projected.split([2 * qk + v, v, heads, heads], dim=-1)

    conv_out, _ = conv_fn(mixed, module.conv1d.weight.squeeze(1), module.conv1d.bias, None)
    dispatch.emit("gdn_conv", module, conv_out)
    query, key, value = conv_out.split([qk, qk, v], dim=-1)
    query = query.reshape(batch, steps, -1, module.key_head_dim)
    key = key.reshape(batch, steps, -1, module.key_head_dim)
    value = value.reshape(batch, steps, -1, module.value_head_dim)
    core_out, _ = core_fn(query, key, value, a, b, module.A_log, module.dt_bias, None)
    dispatch.emit("gdn_core", module, core_out)

    width = module.value_head_dim
    normed = norm(core_out.reshape(-1, width), module.out_norm.weight, float(module.out_norm.eps), False, z.reshape(-1, width))
    dispatch.emit("rms_norm", module.out_norm, normed)
    return module.out_proj(normed.reshape(batch, steps, -1).transpose(0, 1))
