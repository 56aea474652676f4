"""Op-site patching of transformers models: each module that computes an op calls the implementation
installed at the current site.

``prepare_model`` calls ``patch_hf_model`` (its default patcher) when a plugin installed a non-stock
implementation at one of the role's sites. Each patched module asks its ``OpDispatch``
(``skyrl_core.ops.dispatch``, shared with other runtimes' patchers) for the op's implementation at
``current_site()``: the stock implementation is the module's own (original) forward, so a site that
keeps stock numerics computes exactly what transformers computes; any other implementation is
called with the op's calling convention below. Every call is observed in the ledger (the
fingerprint of what ran), including calls made outside any ``site_scope`` (site ``"unscoped"``).

Calling conventions (what an ``OpImplSpec`` factory of each op is called with)::

    embedding(ids, weight, padding_idx)                      -> [..., H]
    linear(x, weight, bias)                                  -> [..., N]
    rms_norm(x, weight, eps, unit_offset, gate)              -> like x
        unit_offset: scale by (1 + weight) (Qwen3-Next); gate: multiply by silu(gate) (gated norm)
    rope(inv_freq, attention_scaling, position_ids, dtype)   -> (cos, sin), [B, T, 2 * len(inv_freq)]
    attention(query, key, value, visible, scaling)           -> [B, Tq, H, D]
        query [B, H, Tq, D], key/value [B, Hkv, Tk, D], visible bool [B, 1, Tq, Tk] (True: attend)
    silu_mul(gate, up)                                       -> silu(gate) * up
    moe_router(x, weight, top_k, normalize)                  -> (weights [T, K] in x.dtype, experts [T, K])
    moe_experts(x, experts, gate_up_proj, down_proj)         -> [T, K, H], one row per routed slot
    moe_combine(expert_out, weights, shared_out, shared_gate_logits) -> [T, H]
        shared_*: the shared expert's output and gate logits (Qwen3-Next), or None
    gdn_conv(x, weight, bias, conv_state)                    -> (silu(causal depthwise conv), new state)
        x [B, T, C], weight [C, W], conv_state [B, C, W-1] or None (zeros)
    gdn_core(q, k, v, a, b, A_log, dt_bias, state)           -> (out [B, T, Hv, Dv], new state)
        q/k [B, T, Hk, Dk], v [B, T, Hv, Dv], a/b [B, T, Hv], state [B, Hv, Dk, Dv] fp32 or None
    logprobs(logits, token_ids)                              -> [...] (see ``token_logprobs``)
        an engine that returns logprobs from the full matrix (vLLM's sampler) calls the
        implementation's attribute ``full_log_softmax(logits) -> [rows, V]`` fp32

Rotary *application* (``q * cos + rotate_half(q) * sin``) stays the model's own code: it is
elementwise, hence identical for every batching; only the cos/sin computation is an op.
"""

from __future__ import annotations

import sys
from typing import Any

from skyrl_core.ops.dispatch import OpDispatch, PatchRecord, attach_dispatch, patch_forward
from skyrl_core.ops.ledger import OpLedger
from skyrl_core.ops.stock import UNSCOPED

__all__ = ["ATTENTION_NAME", "UNSCOPED", "OpDispatch", "patch_hf_model"]

ATTENTION_NAME = "skyrl_ops"

# RMSNorm classes by computation; any other class whose name ends in "RMSNorm" is left unpatched
# and reported (``ledger.meta["unpatched"]``), so that a plugin can refuse it.
_RMS_NORM_PLAIN = {"LlamaRMSNorm", "Qwen3RMSNorm", "Qwen3MoeRMSNorm"}
_RMS_NORM_UNIT_OFFSET = {"Qwen3NextRMSNorm"}
_RMS_NORM_GATED = {"Qwen3NextRMSNormGated"}
_ROPE_TYPES = {"default", "linear", "llama3", "yarn"}  # inv_freq-based, no runtime update
_SITE_CLASS_SUFFIXES = ("RMSNorm", "RMSNormGated", "RotaryEmbedding", "Attention", "MLP", "SparseMoeBlock", "GatedDeltaNet")


def _bare_class_name(module: Any) -> str:
    # FSDP2 swaps a module's class for a subclass named "FSDP<Name>".
    name = type(module).__name__
    return name[4:] if name.startswith("FSDP") and len(name) > 4 else name


_patch = patch_forward  # the name this module used before the dispatch moved to skyrl_core.ops.dispatch


# --- per-op module forwards ---------------------------------------------------------------------


def _linear_forward(module, x):
    return module._skyrl_dispatch.call(
        "linear", module, lambda: module._skyrl_stock_forward(x), lambda fn: fn(x, module.weight, module.bias)
    )


def _embedding_forward(module, ids):
    return module._skyrl_dispatch.call(
        "embedding", module, lambda: module._skyrl_stock_forward(ids), lambda fn: fn(ids, module.weight, module.padding_idx)
    )


def _rms_norm_forward(module, x, gate=None):
    def stock():
        return module._skyrl_stock_forward(x) if gate is None else module._skyrl_stock_forward(x, gate)

    def installed(fn):
        eps = getattr(module, "variance_epsilon", None)
        return fn(x, module.weight, float(module.eps if eps is None else eps), module._skyrl_unit_offset, gate)

    return module._skyrl_dispatch.call("rms_norm", module, stock, installed)


def _rope_forward(module, x, position_ids):
    return module._skyrl_dispatch.call(
        "rope",
        module,
        lambda: module._skyrl_stock_forward(x, position_ids),
        lambda fn: fn(module.inv_freq, float(module.attention_scaling), position_ids, x.dtype),
    )


def _mlp_forward(module, x):
    dispatch = module._skyrl_dispatch
    fn = dispatch.resolve("silu_mul", module)
    if fn is None:
        return module._skyrl_stock_forward(x)
    hidden = fn(module.gate_proj(x), module.up_proj(x))
    dispatch.emit("silu_mul", module, hidden)
    return module.down_proj(hidden)


def _moe_block_forward(module, hidden_states):
    dispatch = module._skyrl_dispatch
    fns = [dispatch.resolve(op, module) for op in ("moe_router", "moe_experts", "moe_combine")]
    if all(fn is None for fn in fns):
        return module._skyrl_stock_forward(hidden_states)
    if any(fn is None for fn in fns):
        raise ValueError("moe_router, moe_experts and moe_combine must be all stock or all non-stock at one site")
    router, experts_fn, combine = fns
    shape = hidden_states.shape
    x = hidden_states.reshape(-1, shape[-1])
    gate, experts = module.gate, module.experts
    weights, chosen = router(x, gate.weight, int(gate.top_k), bool(gate.norm_topk_prob))
    dispatch.emit("moe_router", module, weights)
    expert_out = experts_fn(x, chosen, experts.gate_up_proj, experts.down_proj)
    dispatch.emit("moe_experts", module, expert_out)
    shared_out = shared_logits = None
    if getattr(module, "shared_expert", None) is not None:
        shared_out = module.shared_expert(x)
        shared_logits = module.shared_expert_gate(x)
    out = combine(expert_out, weights, shared_out, shared_logits)
    dispatch.emit("moe_combine", module, out)
    return out.reshape(shape)


# --- attention: a registered transformers attention function ------------------------------------


def _attention_function(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    dispatch: OpDispatch = module._skyrl_dispatch
    fn = dispatch.resolve("attention", module)
    if scaling is None:
        scaling = query.shape[-1] ** -0.5
    if fn is None:
        out = _stock_attention(module, query, key, value, attention_mask, scaling, dropout, **kwargs)
        dispatch.emit("attention", module, out[0])
        return out
    if dropout:
        raise ValueError(f"attention dropout {dropout} is not supported by a non-stock attention implementation")
    if kwargs.get("sliding_window") is not None:
        raise ValueError("sliding-window attention is not supported by a non-stock attention implementation")
    if attention_mask is None:  # no padding, no cache offsets: plain causal
        tq, tk = query.shape[2], key.shape[2]
        attention_mask = _causal_visible(tq, tk, query.device)[None, None].expand(query.shape[0], 1, tq, tk)
    out = fn(query, key, value, attention_mask, float(scaling))
    dispatch.emit("attention", module, out)
    return out, None


def _causal_visible(tq: int, tk: int, device: Any):
    import torch

    return torch.ones(tq, tk, dtype=torch.bool, device=device).tril(tk - tq)


def _stock_attention(module, query, key, value, visible, scaling, dropout, **kwargs):
    """The model's own attention implementation, given a boolean (or an already additive) mask."""
    import torch
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    name = module._skyrl_stock_attention
    if name == "eager":
        additive = visible
        if visible is not None and visible.dtype == torch.bool:
            additive = torch.zeros(visible.shape, dtype=query.dtype, device=query.device)
            additive.masked_fill_(~visible, torch.finfo(query.dtype).min)
        eager = sys.modules[type(module).__module__].eager_attention_forward
        return eager(module, query, key, value, additive, scaling=scaling, dropout=dropout, **kwargs)
    return ALL_ATTENTION_FUNCTIONS[name](module, query, key, value, visible, scaling=scaling, dropout=dropout, **kwargs)


def _boolean_mask(*args, **kwargs):
    """Mask function for ``ATTENTION_NAME``: always a boolean ``[B, 1, Tq, Tk]`` mask, never skipped."""
    from transformers.masking_utils import sdpa_mask

    kwargs["allow_is_causal_skip"] = False
    kwargs.pop("allow_is_bidirectional_skip", None)
    return sdpa_mask(*args, **kwargs)


def _register_attention() -> None:
    from transformers.masking_utils import AttentionMaskInterface
    from transformers.modeling_utils import AttentionInterface

    AttentionInterface.register(ATTENTION_NAME, _attention_function)
    AttentionMaskInterface.register(ATTENTION_NAME, _boolean_mask)


def _set_attention(config: Any) -> str:
    """Point ``config`` (and its sub-configs) at ``ATTENTION_NAME``; return the previous implementation."""
    previous = getattr(config, "_attn_implementation", None) or "eager"
    config._attn_implementation = ATTENTION_NAME
    for key in getattr(config, "sub_configs", {}) or {}:
        sub = getattr(config, key, None)
        if sub is not None:
            sub._attn_implementation = ATTENTION_NAME
    return previous


# --- the patcher ----------------------------------------------------------------------------------


def patch_hf_model(model: Any, ledger: OpLedger) -> None:
    """Route every op site of a transformers causal LM through ``OpDispatch``; idempotent.

    Records in ``ledger.meta``: ``op_modules`` (how many modules compute each op) and ``unpatched`` (modules that look like op sites but have no mapping: a plugin that
    needs every op under its control refuses them).
    """
    from torch import nn

    dispatch = attach_dispatch(model, ledger)
    if dispatch is None:
        return
    record = PatchRecord(dispatch)
    has_attention = False
    for qualname, module in model.named_modules():
        name = _bare_class_name(module)
        if isinstance(module, nn.Linear):
            record.claim(module, qualname, "linear", _linear_forward)
        elif isinstance(module, nn.Embedding):
            record.claim(module, qualname, "embedding", _embedding_forward)
        elif name in _RMS_NORM_PLAIN | _RMS_NORM_UNIT_OFFSET | _RMS_NORM_GATED:
            module._skyrl_unit_offset = name in _RMS_NORM_UNIT_OFFSET
            record.claim(module, qualname, "rms_norm", _rms_norm_forward)
        elif name.endswith("RotaryEmbedding") and getattr(module, "rope_type", None) in _ROPE_TYPES:
            record.claim(module, qualname, "rope", _rope_forward)
        elif name.endswith("MLP") and _is_silu_mlp(module):
            record.claim(module, qualname, "silu_mul", _mlp_forward)
        elif name.endswith("SparseMoeBlock") and _is_topk_moe(module):
            record.claim(module, qualname, "moe_router", _moe_block_forward, also=("moe_experts", "moe_combine"))
        elif name.endswith("GatedDeltaNet"):
            from skyrl_core.ops.hf_gdn import gdn_forward

            record.claim(module, qualname, "gdn_core", gdn_forward, also=("gdn_conv",))
        elif name.endswith("Attention") and hasattr(module, "o_proj"):
            record.claim(module, qualname, "attention")  # dispatches through the registered attention function
            has_attention = True
        elif name.endswith(_SITE_CLASS_SUFFIXES):
            record.refuse(qualname, name)
    if has_attention:
        _register_attention()
        previous = _set_attention(model.config)
        for module in model.modules():
            if hasattr(module, "o_proj") and getattr(module, "_skyrl_dispatch", None) is dispatch:
                module._skyrl_stock_attention = previous
    record.finish(ledger)


def _is_silu_mlp(module: Any) -> bool:
    from torch import nn

    act = getattr(module, "act_fn", None)
    return (
        all(isinstance(getattr(module, p, None), nn.Linear) for p in ("gate_proj", "up_proj", "down_proj"))
        and type(act).__name__ in ("SiLU", "SiLUActivation")
    )


def _is_topk_moe(module: Any) -> bool:
    gate, experts = getattr(module, "gate", None), getattr(module, "experts", None)
    return (
        gate is not None
        and experts is not None
        and all(hasattr(gate, a) for a in ("top_k", "norm_topk_prob", "weight"))
        and all(hasattr(experts, a) for a in ("gate_up_proj", "down_proj"))
    )
