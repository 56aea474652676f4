"""The native decoder's layer walk with every op computed by the implementation an op plugin
installed at the current site (IsoExec's canonical kernels), for Llama-family decoders.

The patched transformers modules (``skyrl_core.ops.hf``) compute the same thing, but a decode step
of a small model is bound by Python there: each layer costs a dozen dispatches, module calls and
reshapes. This walk resolves the ops once per site and calls them directly, keeping everything
that decides the bits exactly as in the patched modules:

- the op boundaries and rounding points: RMSNorm, q/k-norm, the rotary application as
  ``x * cos + rotate_half(x) * sin`` (two products and a sum, as transformers writes it), attention
  over the slot cache with the same mask, residual additions after each projection;
- q/k/v (and gate/up) run as one projection over the fused weight only when the installed linear
  declares ``columns_independent`` (each output column's bits do not depend on the other weight
  rows: IsoExec asserts it in ``test_kernels.py``); otherwise one projection per module;
- every call is observed in the op ledger under the module it stands for, as the patched module
  would record it, so the fingerprint check sees the same calls;
- when the installed linear declares ``onednn_packed_weights`` (it takes weights prepacked by
  ``skyrl_core.ops.onednn.prepack``), the GEMMs read prepacked copies, each kept only if a probe
  gives the plain weight's bits (``prepack_if_same_bits``); ``repack`` renews them.

Used only when every op the walk calls has a non-stock implementation at both engine sites; a
plugin that replaces some ops but not others runs through the patched modules.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
import torch.nn.functional as F

from skyrl_core.ops.install import DEFAULT_IMPLS
from skyrl_core.ops.ledger import OpLedger
from skyrl_core.ops.onednn import prepack_if_same_bits
from skyrl_core.ops.vocabulary import ROLE_SITES, current_site
from skyrl_torch.kv_cache import SlotKVCache
from skyrl_torch.native_decoder import (
    SERIAL_ELEMENTWISE_BELOW,
    LayerWeights,
    ProjectionThreads,
    pack_gemm_operands,
    unsupported_reason,
)

WALKED_OPS = ("embedding", "rope", "rms_norm", "linear", "attention", "silu_mul")
# Keys/values are read from the slot cache in whole multiples of this many positions (the cache's
# capacity is one): a kernel that pads keys to blocks (IsoExec's, to 64) then finds them padded
# and skips its own zero-filled copy. The extra keys are hidden by the mask.
KEY_READ_MULTIPLE = 64
ENGINE_SITES = ROLE_SITES["engine"]


def missing_ops(ledger: OpLedger) -> list[str]:
    """The ``op@site`` pairs the walk needs that hold the stock implementation (empty: it can run)."""
    return [
        f"{op}@{site}"
        for site in ENGINE_SITES
        for op in WALKED_OPS
        if (impl := ledger.impl(op, site)) is None or impl.name == DEFAULT_IMPLS[op].name
    ]


class _SiteOps:
    """The installed implementation of each walked op at one site."""

    def __init__(self, ledger: OpLedger, site: str) -> None:
        self.site = site
        self.names = {op: ledger.impl(op, site).name for op in WALKED_OPS}
        fns: dict[str, Callable[..., Any]] = {op: ledger.impl(op, site).load_factory() for op in WALKED_OPS}
        self.embedding, self.rope, self.rms_norm = fns["embedding"], fns["rope"], fns["rms_norm"]
        self.linear, self.attention, self.silu_mul = fns["linear"], fns["attention"], fns["silu_mul"]
        self.fuse_projections = bool(getattr(self.linear, "columns_independent", False))


class InstalledOpsDecoder:
    """Forward of ``model`` (patched by ``prepare_model``) over a ``SlotKVCache`` with the ops of
    ``ledger``; returns last-token logits."""

    def __init__(self, model: torch.nn.Module, ledger: OpLedger, *, prepack_weights: bool = False) -> None:
        reason = unsupported_reason(model)
        if reason is not None:
            raise NotImplementedError(f"InstalledOpsDecoder cannot run this model: {reason}")
        missing = missing_ops(ledger)
        if missing:
            raise ValueError(f"InstalledOpsDecoder needs non-stock ops; stock at {', '.join(missing)}")
        self.ledger = ledger
        self.model = model
        body = model.model
        self.embed, self.rotary, self.final_norm, self.lm_head = body.embed_tokens, body.rotary_emb, body.norm, model.lm_head
        self.layers = [LayerWeights(layer) for layer in body.layers]
        self._sites = {site: _SiteOps(ledger, site) for site in ENGINE_SITES}
        self._calls = self._calls_per_forward()
        self._prepack = prepack_weights
        self.repack()

    def repack(self) -> None:
        """Renew the GEMM operands from the current weights (call after they change): prepacked
        copies where every site's linear is one implementation that takes them."""
        linears = {ops.names["linear"]: ops.linear for ops in self._sites.values()}
        packer = None
        if self._prepack and len(linears) == 1:
            (linear,) = linears.values()
            if getattr(linear, "onednn_packed_weights", False):
                packer = lambda weight: prepack_if_same_bits(weight, linear)  # noqa: E731
        self.lm_head_gemm, self.prepacked = pack_gemm_operands(self.layers, self.lm_head, packer)

    def _calls_per_forward(self) -> list[tuple[str, str]]:
        """(op, module name) of every op call one forward makes, as the patched modules make them."""
        def name(module: torch.nn.Module) -> str:
            return getattr(module, "_skyrl_name", "")

        calls = [("embedding", name(self.embed)), ("rope", name(self.rotary))]
        for layer in self.layers:
            attn, mlp = layer.attn, layer.mlp
            calls.append(("rms_norm", name(layer.input_norm)))
            calls += [("linear", name(m)) for m in (attn.q_proj, attn.k_proj, attn.v_proj)]
            if layer.q_norm is not None:
                calls += [("rms_norm", name(layer.q_norm)), ("rms_norm", name(layer.k_norm))]
            calls += [("attention", name(attn)), ("linear", name(attn.o_proj)), ("rms_norm", name(layer.post_norm))]
            calls += [("linear", name(mlp.gate_proj)), ("linear", name(mlp.up_proj)), ("silu_mul", name(mlp))]
            calls.append(("linear", name(mlp.down_proj)))
        calls += [("rms_norm", name(self.final_norm)), ("linear", name(self.lm_head))]
        return calls

    def forward(self, cache: SlotKVCache, tokens: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """Logits ``[n, V]`` of each row's last token; ``cache.plan`` must have been called."""
        site = current_site()
        if site not in self._sites:
            raise RuntimeError(f"InstalledOpsDecoder.forward runs inside an engine op site, not {site!r}")
        ops = self._sites[site]
        h = ops.embedding(tokens, self.embed.weight, self.embed.padding_idx)
        cos, sin = ops.rope(self.rotary.inv_freq, float(self.rotary.attention_scaling), positions.clamp(min=0), h.dtype)
        # [n, q, 1, d], broadcast over heads. rotate_half(x) * sin == halves_swapped(x) * [-sin1, sin2]
        # bit for bit (negation is exact), which saves a negation per call.
        half = cos.shape[-1] // 2
        cos, sin = cos.unsqueeze(2), torch.cat((-sin[..., :half], sin[..., half:]), dim=-1).unsqueeze(2)
        visible = mask == 0  # the plan's additive mask as booleans (what the kernel reads)
        with ProjectionThreads(h.device.type == "cpu" and h.numel() < SERIAL_ELEMENTWISE_BELOW) as threads:
            logits = self._layers(ops, h, cos, sin, cache, visible, threads)
        observe = self.ledger.observe
        for op, module in self._calls:
            observe(op, site, ops.names[op], module)
        return logits

    def _layers(self, ops: _SiteOps, h, cos, sin, cache: SlotKVCache, visible, threads: ProjectionThreads) -> torch.Tensor:
        n, q_len = h.shape[:2]
        for index, layer in enumerate(self.layers):
            attn, mlp, d = layer.attn, layer.mlp, layer.head_dim
            threads.serial()
            x = _norm(ops, h, layer.input_norm)
            threads.parallel()
            if ops.fuse_projections:
                qkv = ops.linear(x, layer.qkv_gemm, layer.qkv_bias)
                q, k, v = qkv.split((layer.q_size, layer.kv_size, layer.kv_size), dim=-1)
            else:
                q, k, v = (ops.linear(x, m.weight, m.bias) for m in (attn.q_proj, attn.k_proj, attn.v_proj))
            threads.serial()
            q, k, v = q.unflatten(-1, (-1, d)), k.unflatten(-1, (-1, d)), v.unflatten(-1, (-1, d))
            if layer.q_norm is not None:
                q, k = _norm(ops, q, layer.q_norm), _norm(ops, k, layer.k_norm)
            q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
            keys, values = cache.write_and_read(index, k, v, read_multiple=KEY_READ_MULTIPLE)
            if visible.shape[-1] != keys.shape[2]:
                visible = F.pad(visible, (0, keys.shape[2] - visible.shape[-1]), value=False)
            # All threads: the installed attention may be GEMM-bound where the stock one is not
            # (IsoExec's pads query rows and key slots; measured 5% faster per decode step with 2).
            threads.parallel()
            out = ops.attention(q.transpose(1, 2), keys, values, visible, layer.scaling)  # [n, q, H, d]
            h = h + ops.linear(out.reshape(n, q_len, -1), layer.o_gemm, attn.o_proj.bias)
            threads.serial()
            x = _norm(ops, h, layer.post_norm)
            threads.parallel()
            if ops.fuse_projections:
                gate, up = ops.linear(x, layer.gate_up_gemm, layer.gate_up_bias).chunk(2, dim=-1)
            else:
                gate, up = ops.linear(x, mlp.gate_proj.weight, mlp.gate_proj.bias), ops.linear(x, mlp.up_proj.weight, mlp.up_proj.bias)
            threads.serial()
            act = ops.silu_mul(gate, up)
            threads.parallel()
            h = h + ops.linear(act, layer.down_gemm, mlp.down_proj.bias)
        threads.serial()
        last = _norm(ops, h[:, -1], self.final_norm)
        threads.parallel()
        return ops.linear(last, self.lm_head_gemm, self.lm_head.bias)


def _norm(ops: _SiteOps, x: torch.Tensor, norm: torch.nn.Module) -> torch.Tensor:
    eps = getattr(norm, "variance_epsilon", None)
    return ops.rms_norm(x, norm.weight, float(norm.eps if eps is None else eps), False, None)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor) -> torch.Tensor:
    """``x * cos + rotate_half(x) * sin`` with transformers' rounding points (two products, one sum;
    no fused multiply-add), ``sin_signed`` being ``[-sin1, sin2]``."""
    swapped = x.unflatten(-1, (2, -1)).flip(-2).flatten(-2)
    return (x * cos).add_(swapped.mul_(sin_signed))
