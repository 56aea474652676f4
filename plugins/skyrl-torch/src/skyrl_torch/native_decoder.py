"""A lean forward for Llama-family decoders (Llama, Mistral, Qwen2, Qwen3) over the model's own weights.

Same mathematics as the transformers modules, in fewer and larger kernels, which is what a decode
step of a small model on a CPU is bound by:

- q/k/v projections are one matmul, gate/up one matmul: the model's parameters are re-pointed to
  views of one fused tensor per layer, so ``update_weights`` (which copies into the parameters)
  keeps the fused tensors current and no memory is duplicated;
- RMSNorm takes its mean square from one norm reduction; rotary embedding is one multiply-add on a
  half-swapped view (over queries and keys at once when there is no per-head norm); residual
  additions are fused into the output projections (``addmm``);
- decode attention (one query per row) is ``baddbmm`` (scale and mask included), softmax, ``bmm``
  over the slot cache with query heads grouped under their key/value head, without repeating
  keys/values (measured 1.1-1.4x faster than SDPA at decode batch 64); prefill uses SDPA.

On CPU, matrix products can go to oneDNN (``gemm="onednn"``) instead of the BLAS behind
``torch.nn.functional.linear``: same fp32 arithmetic in another summation order, and on some CPUs
(AMD EPYC with MKL, measured) several times faster at decode batch sizes. With ``prepack`` the
GEMMs read copies of the weights reordered once into oneDNN's blocked layout (``repack`` renews
them after a weight update): the same kernel and bits without that reorder on every call, 12-25%
faster per decode-sized GEMM here, for a second copy of the projection weights in memory. bf16
weights are packed too where oneDNN computes bf16 on the CPU (AVX-512 or newer) (``prepack(..., bf16=True)``: same
bits; before, every bf16 GEMM reordered its weight on each call).

Only used when the engine's op ledger holds the stock implementation of every op; with an op
plugin's implementations installed (IsoExec) the engine runs ``InstalledOpsDecoder``
(``installed_ops_decoder.py``), the same walk on the installed ops.
"""

from __future__ import annotations

import functools
from typing import Callable

import torch
import torch.nn.functional as F

from skyrl_core.ops.onednn import computes as onednn_computes
from skyrl_core.ops.onednn import mm_nt, mm_nt_add, prepack
from skyrl_torch.kv_cache import SlotKVCache

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")

# Below this many hidden-state elements (decode-sized batches) everything but the projections
# (element-wise kernels and the small per-row attention products) runs on one thread.
SERIAL_ELEMENTWISE_BELOW = 1 << 18


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


class LayerWeights:
    """One decoder layer's modules, with q/k/v and gate/up weights fused (the modules' parameters
    become views of the fused tensors)."""

    def __init__(self, layer: torch.nn.Module) -> None:
        attn, mlp = layer.self_attn, layer.mlp
        self.attn, self.mlp = attn, mlp
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
        self.pack(None)

    def pack(self, packer: Callable[[torch.Tensor], torch.Tensor | None] | None) -> None:
        """Set the operands handed to the GEMMs (``qkv_gemm``, ``o_gemm``, ``gate_up_gemm``,
        ``down_gemm``): ``packer(weight)`` where it returns a packed copy, else the weight itself."""
        def operand(weight: torch.Tensor) -> torch.Tensor:
            packed = None if packer is None else packer(weight)
            return weight if packed is None else packed

        self.qkv_gemm, self.gate_up_gemm = operand(self.qkv_weight), operand(self.gate_up_weight)
        self.o_gemm, self.down_gemm = operand(self.o_proj.weight), operand(self.down_proj.weight)


def pack_gemm_operands(
    layers: list[LayerWeights], lm_head: torch.nn.Module, packer: Callable[[torch.Tensor], torch.Tensor | None] | None
) -> tuple[torch.Tensor, int]:
    """Set every layer's GEMM operands with ``packer`` (``LayerWeights.pack``); return the lm_head's
    operand and how many operands are packed copies."""
    for layer in layers:
        layer.pack(packer)
    packed = None if packer is None else packer(lm_head.weight)
    head = lm_head.weight if packed is None else packed
    count = sum(
        operand is not weight
        for layer in layers
        for operand, weight in ((layer.qkv_gemm, layer.qkv_weight), (layer.o_gemm, layer.o_proj.weight),
                                (layer.gate_up_gemm, layer.gate_up_weight), (layer.down_gemm, layer.down_proj.weight))
    )
    return head, count + (head is not lm_head.weight)


def _rms_norm(x: torch.Tensor, norm: torch.nn.Module) -> torch.Tensor:
    """``weight * (x * rsqrt(mean(x^2) + eps))`` in fp32 like transformers' RMSNorm, in three full-size
    kernels (one norm reduction, two multiplies) instead of the seven of the stock decomposition."""
    ms = torch.linalg.vector_norm(x if x.dtype == torch.float32 else x.float(), dim=-1, keepdim=True)
    inv = ms.square_().div_(x.shape[-1]).add_(norm.variance_epsilon).rsqrt_()
    if x.dtype == torch.float32:
        return (x * inv).mul_(norm.weight)
    return (x.float() * inv).to(x.dtype).mul_(norm.weight)


# onednn: oneDNN products in the model's dtype; torch: F.linear / addmm; onednn_fp32: a bf16 model's
# products in fp32 on oneDNN (fp32 copies of the weights, results rounded to bf16), for CPUs where
# neither oneDNN nor PyTorch multiplies bf16 fast (AVX2 only: 110-150 GFLOP/s against 2-20).
GEMMS = ("onednn", "torch", "onednn_fp32")
# Attention runs on every thread when rows x keys reach this: at decode batch 64 over ~70 keys
# (SmolLM2, 2 threads) that made a whole rollout 13% faster; small batches stay on one thread.
PARALLEL_ATTENTION_MIN_SCORES = 2048


def _torch_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    return F.linear(x, weight, bias)


def _torch_residual_linear(residual: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``residual + x @ weight.T (+ bias)`` in one GEMM (``addmm``) over the flattened rows."""
    shape = residual.shape
    base = residual.reshape(-1, shape[-1])
    if bias is not None:
        base = base + bias
    return torch.addmm(base, x.reshape(-1, x.shape[-1]), weight.t()).view(shape)


def _onednn_residual_linear(residual: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``residual + x @ weight.T (+ bias)`` with the addition fused into the oneDNN GEMM."""
    return mm_nt_add(x, weight, bias, residual)


def _fp32(t: torch.Tensor | None) -> torch.Tensor | None:
    return t if t is None or t.dtype == torch.float32 else t.float()


def _fp32_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ weight.T (+ bias)`` as an fp32 oneDNN product rounded to ``x``'s dtype; ``weight`` is an
    fp32 (packed) copy, or the model's own weight between ``unpack`` and ``repack``."""
    return mm_nt(x.float(), _fp32(weight), _fp32(bias)).to(x.dtype)


def _fp32_residual_linear(residual: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``residual + x @ weight.T (+ bias)`` in one fp32 oneDNN call, rounded once to the residual's dtype."""
    return mm_nt_add(x.float(), _fp32(weight), _fp32(bias), residual.float()).to(residual.dtype)


def _fp32_copy(prepack_weights: bool) -> Callable[[torch.Tensor], torch.Tensor | None]:
    """``onednn_fp32``'s packer: each weight's fp32 copy, in oneDNN's blocked layout with ``prepack_weights``."""
    def packer(weight: torch.Tensor) -> torch.Tensor:
        wide = weight.detach().float()
        packed = prepack(wide) if prepack_weights else None
        return wide if packed is None else packed

    return packer


class NativeDecoder:
    """Forward of ``model`` over a ``SlotKVCache``, returning last-token logits."""

    def __init__(self, model: torch.nn.Module, *, gemm: str = "torch", prepack_weights: bool = False, torch_below_macs: int = 0) -> None:
        reason = unsupported_reason(model)
        if reason is not None:
            raise NotImplementedError(f"NativeDecoder cannot run this model: {reason}")
        if gemm not in GEMMS:
            raise ValueError(f"gemm must be one of {', '.join(GEMMS)}; got {gemm!r}")
        if gemm == "onednn" and not onednn_computes(model.dtype):
            raise ValueError(f"gemm='onednn' needs oneDNN products in {model.dtype} here: a PyTorch built with oneDNN "
                             "(mkldnn), and for bf16 a CPU with AVX-512 or newer; use gemm='onednn_fp32' or 'torch'")
        if gemm == "onednn_fp32" and (model.dtype != torch.bfloat16 or not onednn_computes(torch.float32)):
            raise ValueError(f"gemm='onednn_fp32' is for a bf16 model on a PyTorch built with oneDNN; this model is {model.dtype}")
        self.gemm = gemm
        self._linear = {"onednn": mm_nt, "torch": _torch_linear, "onednn_fp32": _fp32_linear}[gemm]
        self._residual_linear = {"onednn": _onednn_residual_linear, "torch": _torch_residual_linear,
                                 "onednn_fp32": _fp32_residual_linear}[gemm]
        # fp32 products of fewer multiply-adds than this go through torch (F.linear / addmm on the
        # weights themselves): below about 2M a call, oneDNN's per-call cost outweighs its faster
        # kernel (skyrl-torch's `torch_gemm_below_macs`)
        self.torch_below_macs = torch_below_macs if gemm == "onednn" and model.dtype == torch.float32 else 0
        body = model.model
        self.embed = body.embed_tokens
        self.rotary = body.rotary_emb
        self.final_norm = body.norm
        self.lm_head = model.lm_head
        self.layers = [LayerWeights(layer) for layer in body.layers]
        self.parallel_attention_min_scores = PARALLEL_ATTENTION_MIN_SCORES
        self._packer = functools.partial(prepack, bf16=True) if prepack_weights and gemm == "onednn" else None
        # onednn_fp32: the fp32 copies are needed either way, packed only with prepack_weights
        self._plain_copies = gemm == "onednn_fp32" and not prepack_weights
        if gemm == "onednn_fp32":
            self._packer = _fp32_copy(prepack_weights)
        self.repack()

    def repack(self) -> None:
        """Renew the GEMM operands from the current weights (call after they change)."""
        self.lm_head_gemm, copies = pack_gemm_operands(self.layers, self.lm_head, self._packer)
        self.prepacked = 0 if self._plain_copies else copies  # packed copies (plain fp32 ones are not)

    def unpack(self) -> None:
        """Drop the packed copies: the GEMMs read the weights themselves until ``repack`` (the
        engine sleeps while the trainer needs the memory; the copies are renewed at wake)."""
        self.lm_head_gemm, self.prepacked = pack_gemm_operands(self.layers, self.lm_head, None)

    def forward(self, cache: SlotKVCache, tokens: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """Logits ``[n, V]`` of each row's last token; ``cache.plan`` must have been called."""
        n, q_len = tokens.shape
        h = self.embed(tokens)
        cos, sin = self.rotary(h, positions.clamp(min=0))
        # rotate_half(x) * sin == swap_halves(x) * [-sin_1, sin_2]: one multiply on a view.
        half = cos.shape[-1] // 2
        cos = cos.unsqueeze(2)
        sin = torch.cat([-sin[..., :half], sin[..., half:]], dim=-1).unsqueeze(2)
        with ProjectionThreads(h.device.type == "cpu" and h.numel() < SERIAL_ELEMENTWISE_BELOW) as threads:
            return self._layers(h, cos, sin, cache, mask, threads)

    def _layers(
        self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache: SlotKVCache, mask: torch.Tensor, threads: ProjectionThreads
    ) -> torch.Tensor:
        n, q_len = h.shape[:2]
        decode_masks: dict[int, torch.Tensor] = {}  # per kv-head count: the mask repeated per head
        for index, layer in enumerate(self.layers):
            d, qs, kvs = layer.head_dim, layer.q_size, layer.kv_size
            threads.serial()
            x = _rms_norm(h, layer.input_norm)
            threads.parallel()
            qkv = self._project(x, layer.qkv_gemm, layer.qkv_weight, layer.qkv_bias)
            threads.serial()
            v = qkv[..., qs + kvs :].unflatten(-1, (-1, d))
            if layer.q_norm is None:
                qk = _rope(qkv[..., : qs + kvs].unflatten(-1, (-1, d)), cos, sin)
                q, k = qk[:, :, : qs // d], qk[:, :, qs // d :]
            else:
                q = _rope(_rms_norm(qkv[..., :qs].unflatten(-1, (-1, d)), layer.q_norm), cos, sin)
                k = _rope(_rms_norm(qkv[..., qs : qs + kvs].unflatten(-1, (-1, d)), layer.k_norm), cos, sin)
            keys, values = cache.write_and_read(index, k, v)
            if n * keys.shape[2] >= self.parallel_attention_min_scores:
                threads.parallel()
            if q_len == 1:
                kv_heads = keys.shape[1]
                if kv_heads not in decode_masks:
                    decode_masks[kv_heads] = mask.expand(n, kv_heads, 1, -1).reshape(n * kv_heads, 1, -1)
                attn = _decode_attention(q, keys, values, decode_masks[kv_heads], layer.scaling)
            else:
                attn = F.scaled_dot_product_attention(
                    q.transpose(1, 2), keys, values, attn_mask=mask, scale=layer.scaling, enable_gqa=True
                ).transpose(1, 2)
            threads.parallel()
            h = self._project_onto(h, attn.reshape(n, q_len, -1), layer.o_gemm, layer.o_proj.weight, layer.o_proj.bias)
            threads.serial()
            x = _rms_norm(h, layer.post_norm)
            threads.parallel()
            gate, up = self._project(x, layer.gate_up_gemm, layer.gate_up_weight, layer.gate_up_bias).chunk(2, dim=-1)
            threads.serial()
            act = F.silu(gate).mul_(up)
            threads.parallel()
            h = self._project_onto(h, act, layer.down_gemm, layer.down_proj.weight, layer.down_proj.bias)
        threads.serial()
        last = _rms_norm(h[:, -1], self.final_norm)
        threads.parallel()
        return self._project(last, self.lm_head_gemm, self.lm_head.weight, None)

    def _project(self, x: torch.Tensor, operand: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """``x @ weight.T (+ bias)``: by the chosen GEMM on its ``operand`` (``weight`` or a packed
        copy of it), or by torch on ``weight`` when the product is small (``torch_below_macs``)."""
        if x.numel() * weight.shape[0] < self.torch_below_macs:
            return _torch_linear(x, weight, bias)
        return self._linear(x, operand, bias)

    def _project_onto(self, residual: torch.Tensor, x: torch.Tensor, operand: torch.Tensor, weight: torch.Tensor,
                      bias: torch.Tensor | None) -> torch.Tensor:
        """``residual + x @ weight.T (+ bias)``, chosen as ``_project`` chooses."""
        if x.numel() * weight.shape[0] < self.torch_below_macs:
            return _torch_residual_linear(residual, x, weight, bias)
        return self._residual_linear(residual, x, operand, bias)


class ProjectionThreads:
    """Intra-op threads for the projections only: element-wise kernels and attention's many tiny
    products on decode-sized tensors gain little from more threads, and each parallel region waits
    for every thread to be scheduled, which on a busy machine costs milliseconds."""

    def __init__(self, enabled: bool) -> None:
        self.full = torch.get_num_threads()
        self.enabled = enabled and self.full > 1
        self.current = self.full

    def serial(self) -> None:
        if self.enabled and self.current != 1:
            torch.set_num_threads(1)
            self.current = 1

    def parallel(self) -> None:
        if self.enabled and self.current != self.full:
            torch.set_num_threads(self.full)
            self.current = self.full

    def __enter__(self) -> ProjectionThreads:
        return self

    def __exit__(self, *exc: object) -> None:
        if self.current != self.full:
            torch.set_num_threads(self.full)
            self.current = self.full


def _rope(x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor) -> torch.Tensor:
    """Rotary embedding of ``x [n, q, heads, d]`` (transformers' rotate-half convention)."""
    swapped = x.unflatten(-1, (2, -1)).flip(-2).flatten(-2)
    return torch.addcmul(x * cos, swapped, sin_signed)


def _decode_attention(
    q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, scaling: float
) -> torch.Tensor:
    """One query per row: ``q [n, 1, Hq, d]`` over ``keys/values [n, Hkv, L, d]`` with ``mask
    [n * Hkv, 1, L]`` (additive) -> ``[n, 1, Hq, d]``.

    Query heads are grouped under their key/value head (head ``h`` uses kv head ``h // group``, as
    in transformers), so keys/values are read in place, never repeated.
    """
    n, _, hq, d = q.shape
    hkv, length = keys.shape[1], keys.shape[2]
    grouped = q.reshape(n * hkv, hq // hkv, d)
    scores = torch.baddbmm(mask, grouped, keys.reshape(n * hkv, length, d).transpose(1, 2), alpha=scaling)
    if scores.dtype == torch.float32:
        probs = torch.softmax(scores, dim=-1)
    else:  # softmax in fp32, as transformers does
        probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(values.dtype)
    return torch.bmm(probs, values.reshape(n * hkv, length, d)).view(n, 1, hq, d)
