"""A lean forward for Llama-family decoders (Llama, Mistral, Qwen2, Qwen3) over the model's own weights.

Same mathematics as the transformers modules, in fewer and larger kernels, which is what a decode
step of a small model on a CPU is bound by:

- q/k/v projections are one matmul, gate/up one matmul: the model's parameters are re-pointed to
  views of one fused tensor per layer, so ``update_weights`` (which copies into the parameters)
  keeps the fused tensors current and no memory is duplicated;
- rotary embedding is one multiply-add per tensor on a half-swapped view, residual additions are
  fused into the output projections (``addmm``);
- decode attention (one query per row) is two batched matmuls over the slot cache with grouped
  query heads, without repeating keys/values; prefill uses SDPA.

Only used when the engine's op ledger holds the stock implementation of every op: an op plugin
(IsoExec) patches the transformers modules, and then the engine runs those modules instead.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from skyrl_torch.kv_cache import SlotKVCache

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")


def unsupported_reason(model: torch.nn.Module) -> str | None:
    """Why ``NativeDecoder`` cannot run ``model`` (None when it can)."""
    config = model.config
    if config.model_type not in SUPPORTED_MODEL_TYPES:
        return f"model_type {config.model_type!r} is not one of {', '.join(SUPPORTED_MODEL_TYPES)}"
    if getattr(config, "hidden_act", "silu") != "silu":
        return f"hidden_act {config.hidden_act!r} is not silu"
    if getattr(config, "use_sliding_window", False) or (
        config.model_type == "mistral" and getattr(config, "sliding_window", None)
    ):
        return "sliding-window attention"
    body = getattr(model, "model", None)
    if body is None or not hasattr(body, "layers") or not hasattr(body, "rotary_emb"):
        return "the model has no .model.layers / .model.rotary_emb"
    for layer in body.layers:
        attn, mlp = layer.self_attn, layer.mlp
        if not all(hasattr(attn, n) for n in ("q_proj", "k_proj", "v_proj", "o_proj", "scaling")):
            return "attention modules are not q/k/v/o projections"
        if not all(hasattr(mlp, n) for n in ("gate_proj", "up_proj", "down_proj")):
            return "MLP modules are not gate/up/down projections"
    if getattr(model.lm_head, "bias", None) is not None:
        return "lm_head has a bias"
    return None


def _fuse(linears: list[torch.nn.Linear]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One weight (and bias) stacked from ``linears``, whose parameters become views of it."""
    weight = torch.cat([m.weight.detach() for m in linears])
    has_bias = [m.bias is not None for m in linears]
    bias = None
    if any(has_bias):
        bias = torch.cat(
            [m.bias.detach() if m.bias is not None else weight.new_zeros(m.weight.shape[0]) for m in linears]
        )
    start = 0
    for m in linears:
        rows = m.weight.shape[0]
        m.weight.data = weight[start : start + rows]
        if m.bias is not None:
            m.bias.data = bias[start : start + rows]
        start += rows
    return weight, bias


class _Layer:
    def __init__(self, layer: torch.nn.Module) -> None:
        attn, mlp = layer.self_attn, layer.mlp
        self.qkv_weight, self.qkv_bias = _fuse([attn.q_proj, attn.k_proj, attn.v_proj])
        self.gate_up_weight, self.gate_up_bias = _fuse([mlp.gate_proj, mlp.up_proj])
        self.o_proj, self.down_proj = attn.o_proj, mlp.down_proj
        self.input_norm, self.post_norm = layer.input_layernorm, layer.post_attention_layernorm
        self.q_norm = getattr(attn, "q_norm", None)
        self.k_norm = getattr(attn, "k_norm", None)
        self.head_dim = int(attn.head_dim)
        self.q_size = int(attn.q_proj.weight.shape[0])
        self.kv_size = int(attn.k_proj.weight.shape[0])
        self.scaling = float(attn.scaling)


def _rms_norm(x: torch.Tensor, norm: torch.nn.Module) -> torch.Tensor:
    return F.rms_norm(x, (x.shape[-1],), norm.weight, norm.variance_epsilon)


def _residual_linear(residual: torch.Tensor, x: torch.Tensor, linear: torch.nn.Linear) -> torch.Tensor:
    """``residual + linear(x)`` in one GEMM (``addmm``) over the flattened rows."""
    shape = residual.shape
    base = residual.reshape(-1, shape[-1])
    if linear.bias is not None:
        base = base + linear.bias
    return torch.addmm(base, x.reshape(-1, x.shape[-1]), linear.weight.t()).view(shape)


class NativeDecoder:
    """Forward of ``model`` over a ``SlotKVCache``, returning last-token logits."""

    def __init__(self, model: torch.nn.Module) -> None:
        reason = unsupported_reason(model)
        if reason is not None:
            raise NotImplementedError(f"NativeDecoder cannot run this model: {reason}")
        body = model.model
        self.embed = body.embed_tokens
        self.rotary = body.rotary_emb
        self.final_norm = body.norm
        self.lm_head = model.lm_head
        self.layers = [_Layer(layer) for layer in body.layers]

    def forward(self, cache: SlotKVCache, tokens: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """Logits ``[n, V]`` of each row's last token; ``cache.plan`` must have been called."""
        n, q_len = tokens.shape
        h = self.embed(tokens)
        cos, sin = self.rotary(h, positions.clamp(min=0))
        # rotate_half(x) * sin == swap_halves(x) * [-sin_1, sin_2]: one multiply on a view.
        half = cos.shape[-1] // 2
        cos = cos.unsqueeze(2)
        sin = torch.cat([-sin[..., :half], sin[..., half:]], dim=-1).unsqueeze(2)
        for index, layer in enumerate(self.layers):
            d = layer.head_dim
            x = _rms_norm(h, layer.input_norm)
            qkv = F.linear(x, layer.qkv_weight, layer.qkv_bias)
            q = qkv[..., : layer.q_size].unflatten(-1, (-1, d))
            k = qkv[..., layer.q_size : layer.q_size + layer.kv_size].unflatten(-1, (-1, d))
            v = qkv[..., layer.q_size + layer.kv_size :].unflatten(-1, (-1, d))
            if layer.q_norm is not None:
                q, k = _rms_norm(q, layer.q_norm), _rms_norm(k, layer.k_norm)
            q, k = _rope(q, cos, sin), _rope(k, cos, sin)
            keys, values = cache.write_and_read(index, k, v)
            if q_len == 1:
                attn = _decode_attention(q, keys, values, mask, layer.scaling)
            else:
                attn = F.scaled_dot_product_attention(
                    q.transpose(1, 2), keys, values, attn_mask=mask, scale=layer.scaling, enable_gqa=True
                ).transpose(1, 2)
            h = _residual_linear(h, attn.reshape(n, q_len, -1), layer.o_proj)
            x = _rms_norm(h, layer.post_norm)
            gate, up = F.linear(x, layer.gate_up_weight, layer.gate_up_bias).chunk(2, dim=-1)
            h = _residual_linear(h, F.silu(gate).mul_(up), layer.down_proj)
        last = _rms_norm(h[:, -1], self.final_norm)
        return F.linear(last, self.lm_head.weight)


def _rope(x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor) -> torch.Tensor:
    """Rotary embedding of ``x [n, q, heads, d]`` (transformers' rotate-half convention)."""
    swapped = x.unflatten(-1, (2, -1)).flip(-2).flatten(-2)
    return torch.addcmul(x * cos, swapped, sin_signed)


def _decode_attention(
    q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, scaling: float
) -> torch.Tensor:
    """One query per row: ``q [n, 1, Hq, d]`` over ``keys/values [n, Hkv, L, d]`` -> ``[n, 1, Hq, d]``.

    Query heads are grouped under their key/value head (head ``h`` uses kv head ``h // group``, as
    in transformers), so no key/value is repeated.
    """
    n, _, hq, d = q.shape
    hkv = keys.shape[1]
    grouped = q.reshape(n, hkv, hq // hkv, d)
    scores = torch.matmul(grouped, keys.transpose(-1, -2)).mul_(scaling).add_(mask)
    out = torch.matmul(torch.softmax(scores, dim=-1, dtype=torch.float32).to(values.dtype), values)
    return out.reshape(n, 1, hq, d)
