"""Routed forwards for the layer shapes that vLLM and SGLang share (an engine plugin's op sites
put these on its layers' instances; ``skyrl_vllm.op_sites``, ``skyrl_sglang.op_sites``).

Each asks the layer's ``OpDispatch`` (``skyrl_core.ops.dispatch``, ``layer._skyrl_dispatch``) for
the implementation at the current site and calls it with the op's calling convention
(``skyrl_core.ops.hf``); where the stock one is installed, the layer's own code runs:

- a linear method's ``apply(layer, x, bias)`` over the plain ``[N, K]`` weight: a merged layer
  (``output_partition_sizes``: q/k/v, gate/up) runs one call per logical piece, as the trainer's
  separate projections, unless the implementation declares ``columns_independent``; a one-call
  fp32 weight is prepacked for oneDNN when the implementation gives the same bits from it;
- an lm_head over its ``org_vocab_size`` real rows (engines pad the vocabulary), an embedding;
- a fused residual-add RMSNorm: ``residual + x`` rounded to the model dtype first (the trainer's
  residual add), then the op; Gemma's ``1 + weight`` (``_skyrl_unit_offset``); a gated norm;
- ``SiluAndMul``; a neox-style rotary: cos/sin from the op (kept while the positions repeat),
  applied as transformers does.
"""

from __future__ import annotations

from typing import Any, Callable

import attrs
import torch
import torch.nn.functional as F

from skyrl_core.ops import onednn
from skyrl_core.ops.dispatch import OpDispatch, PatchRecord
from skyrl_core.ops.rotary import default_inv_freq
from skyrl_core.ops.stock import is_stock
from skyrl_core.ops.vocabulary import ROLE_SITES


def _pieces(layer: torch.nn.Module, fn: Callable[..., Any]) -> tuple[int, ...]:
    rows = int(layer.weight.shape[0])
    sizes = tuple(int(n) for n in getattr(layer, "output_partition_sizes", ()) or ())
    if len(sizes) < 2 or sum(sizes) != rows or getattr(fn, "columns_independent", False):
        return (rows,)
    return sizes


def prepare_linear(layer: torch.nn.Module, fn: Callable[..., Any]) -> None:
    """The layer's logical pieces for ``fn`` and, for one GEMM, its oneDNN-packed weight if ``fn``
    gives the same bits from it."""
    layer._skyrl_linear_fn = fn
    layer._skyrl_pieces = pieces = _pieces(layer, fn)
    weight = layer.weight
    if getattr(layer, "_skyrl_vocab", None) is not None:
        weight = weight.narrow(0, 0, layer._skyrl_vocab)
    layer._skyrl_packed = onednn.prepack_if_same_bits(weight, fn) if len(pieces) == 1 and weight.dim() == 2 else None


def _run_linear(fn: Callable[..., Any], layer: torch.nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    if fn is not layer._skyrl_linear_fn:
        prepare_linear(layer, fn)
    pieces, weight = layer._skyrl_pieces, layer.weight
    if len(pieces) == 1:
        return fn(x, weight if layer._skyrl_packed is None else layer._skyrl_packed, bias)
    outputs, start = [], 0
    for rows in pieces:
        outputs.append(fn(x, weight.narrow(0, start, rows), None if bias is None else bias.narrow(0, start, rows)))
        start += rows
    return torch.cat(outputs, dim=-1)


def routed_linear_apply(layer: torch.nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """A linear method's ``apply`` on a routed layer (set on its method instance). Where the stock
    implementation is installed, the method's own kernel runs, or ``F.linear`` on a layer whose
    weight the engine kept plain for the op (``_skyrl_plain``: vLLM-CPU's kernel reads a prepacked
    copy that was then never made)."""
    method = layer.quant_method

    def stock() -> torch.Tensor:
        if getattr(layer, "_skyrl_plain", False):
            return F.linear(x, layer.weight, bias)
        return type(method).apply(method, layer, x, bias)

    return layer._skyrl_dispatch.call("linear", layer, stock, lambda fn: _run_linear(fn, layer, x, bias))


def _lm_head_logits(fn: Callable[..., Any], layer: torch.nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    if fn is not layer._skyrl_linear_fn:
        prepare_linear(layer, fn)
    vocab, packed = layer._skyrl_vocab, layer._skyrl_packed
    logits = fn(x, layer.weight.narrow(0, 0, vocab) if packed is None else packed, None if bias is None else bias.narrow(0, 0, vocab))
    padded = int(layer.weight.shape[0])
    return logits if padded == vocab else F.pad(logits, (0, padded - vocab))  # the engine's padding, cut by its logits processor


def routed_lm_head_apply(layer: torch.nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``UnquantizedEmbeddingMethod.apply`` of a routed lm_head (set on its method instance)."""
    stock = type(layer.quant_method).apply
    return layer._skyrl_dispatch.call(
        "linear", layer, lambda: stock(layer.quant_method, layer, x, bias), lambda fn: _lm_head_logits(fn, layer, x, bias)
    )


def routed_embedding(layer: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    """``UnquantizedEmbeddingMethod.embedding`` of a routed input embedding."""
    stock = type(layer.quant_method).embedding
    return layer._skyrl_dispatch.call(
        "embedding", layer, lambda: stock(layer.quant_method, layer, ids), lambda fn: fn(ids, layer.weight, None)
    )


def rms_norm_forward(module, x, residual=None):
    weight = module.weight if getattr(module, "has_weight", True) else torch.ones_like(module.weight)

    def installed(fn):
        if residual is None:
            return fn(x, weight, float(module.variance_epsilon), module._skyrl_unit_offset, None)
        summed = residual + x  # the trainer's residual add, rounded to the model dtype
        return fn(summed, weight, float(module.variance_epsilon), module._skyrl_unit_offset, None), summed

    return module._skyrl_dispatch.call("rms_norm", module, lambda: module._skyrl_stock_forward(x, residual), installed)


def gated_norm_forward(module, x, z=None):
    return module._skyrl_dispatch.call(
        "rms_norm", module, lambda: module._skyrl_stock_forward(x, z), lambda fn: fn(x, module.weight, float(module.eps), False, z)
    )


def silu_mul_forward(module, x):
    d = x.shape[-1] // 2
    return module._skyrl_dispatch.call("silu_mul", module, lambda: module._skyrl_stock_forward(x), lambda fn: fn(x[..., :d], x[..., d:]))


def _swap_halves(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((x[..., half:], x[..., :half]), dim=-1)


def _rotate(module, x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """transformers' ``x * cos + rotate_half(x) * sin`` on the first ``rotary_dim`` channels, as
    ``x * cos + swap_halves(x) * [-sin1, sin2]``: ``(-a) * b`` and ``a * (-b)`` round alike, so
    the bits are transformers' with two fewer passes."""
    shape = x.shape
    x = x.view(cos.shape[0], -1, module.head_size)
    rot = x[..., : module.rotary_dim]
    rotated = (rot * cos).add_(_swap_halves(rot).mul_(signed_sin))
    if module.rotary_dim == module.head_size:
        return rotated.view(shape)
    return torch.cat((rotated, x[..., module.rotary_dim:]), dim=-1).reshape(shape)


def _cos_signed_sin(module, fn: Callable[..., Any], positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """``cos`` and ``[-sin1, sin2]`` ``[T, 1, rotary_dim]`` from ``fn`` for ``positions`` ``[T]``. The
    last lookup is kept while the positions (compared by value: engines rewrite their positions
    buffer in place) and dtype are the same: every layer of a step rotates at the same ones."""
    last = module._skyrl_rope_last
    if (last is not None and last[0] is fn and last[2] == dtype and last[1].shape == positions.shape
            and torch.equal(last[1], positions)):
        return last[3], last[4]
    cos, sin = fn(module._skyrl_inv_freq, 1.0, positions.unsqueeze(0), dtype)
    cos, sin = cos[0], sin[0]
    half = module.rotary_dim // 2
    signed = torch.cat((-sin[..., :half], sin[..., half:]), dim=-1)
    cos, signed = cos.unsqueeze(1), signed.unsqueeze(1)  # broadcast over heads
    module._skyrl_rope_last = (fn, positions.clone(), dtype, cos, signed)
    return cos, signed


def rope_forward(module, positions, query, key=None):
    def installed(fn):
        cos, signed_sin = _cos_signed_sin(module, fn, positions.flatten(), query.dtype)
        return _rotate(module, query, cos, signed_sin), None if key is None else _rotate(module, key, cos, signed_sin)

    return module._skyrl_dispatch.call("rope", module, lambda: module._skyrl_stock_forward(positions, query, key), installed)


@attrs.frozen
class LayerClasses:
    """An engine's classes for each layer shape above (tuples: any of them), and two predicates:
    ``plain_rotary(module)``: a rotary whose arithmetic is the default one; ``plain_weight(module)``:
    a linear whose ``weight`` holds the plain ``[N, K]`` matrix."""

    linear: type
    linear_method: type
    embedding: type
    lm_head: type
    embedding_method: type
    rms_norm: tuple[type, ...]
    unit_offset_norm: tuple[type, ...]
    gated_norm: tuple[type, ...]
    silu_mul: tuple[type, ...]
    rotary: tuple[type, ...]
    plain_rotary: Callable[[Any], bool]
    plain_weight: Callable[[Any], bool]


def route_layers(model: torch.nn.Module, dispatch: OpDispatch, routed: dict[str, list[str]], classes: LayerClasses) -> PatchRecord:
    """Put the routed forwards on every layer of ``model`` computing one of the ``routed`` ops; a
    layer of such an op with no mapping (a quantized linear, a scaled rotary, a grouped gated norm)
    is refused (``PatchRecord.unpatched``)."""
    record = PatchRecord(dispatch)
    for qualname, module in model.named_modules():
        method = getattr(module, "quant_method", None)
        if isinstance(module, classes.linear) and "linear" in routed:
            if isinstance(method, classes.linear_method) and classes.plain_weight(module):
                module._skyrl_linear_fn = None
                record.claim(module, qualname, "linear")
                method.apply = routed_linear_apply
            else:
                record.refuse(qualname, type(module).__name__)
        elif isinstance(module, classes.embedding) and isinstance(method, classes.embedding_method):
            if isinstance(module, classes.lm_head) and "linear" in routed:
                module._skyrl_vocab = int(getattr(module, "org_vocab_size", module.weight.shape[0]))
                module._skyrl_linear_fn = None
                record.claim(module, qualname, "linear")
                method.apply = routed_lm_head_apply
            elif not isinstance(module, classes.lm_head) and "embedding" in routed:
                record.claim(module, qualname, "embedding")
                method.embedding = routed_embedding
        elif isinstance(module, classes.gated_norm) and "rms_norm" in routed:
            if (getattr(module, "group_size", None) not in (None, module.weight.shape[-1]) or not getattr(module, "norm_before_gate", True)
                    or getattr(module, "activation", "silu") not in ("silu", "swish")):
                record.refuse(qualname, type(module).__name__)
            else:
                record.claim(module, qualname, "rms_norm", gated_norm_forward)
        elif isinstance(module, classes.rms_norm + classes.unit_offset_norm) and "rms_norm" in routed:
            if getattr(module, "variance_size_override", None) is not None:
                record.refuse(qualname, type(module).__name__)
            else:
                module._skyrl_unit_offset = isinstance(module, classes.unit_offset_norm)
                record.claim(module, qualname, "rms_norm", rms_norm_forward)
        elif isinstance(module, classes.silu_mul) and "silu_mul" in routed:
            record.claim(module, qualname, "silu_mul", silu_mul_forward)
        elif isinstance(module, classes.rotary) and "rope" in routed:
            if classes.plain_rotary(module) and module.is_neox_style:
                module._skyrl_inv_freq = default_inv_freq(module.base, module.rotary_dim)
                module._skyrl_rope_last = None
                record.claim(module, qualname, "rope", rope_forward)
            else:  # scaled / multimodal / interleaved rotary: no mapping onto the op's convention
                record.refuse(qualname, type(module).__name__)
    return record


def _prepare_linears(model: torch.nn.Module, dispatch: OpDispatch, ledger: Any) -> None:
    """Prepare every routed linear for the one linear implementation installed at the engine's
    sites (its pieces, its prepacked weight), at load rather than in the first step; with two
    different ones (prefill and decode) each call prepares its own."""
    impls = {ledger.impl("linear", site) for site in ROLE_SITES["engine"]} - {None}
    if len(impls) != 1 or is_stock(next(iter(impls))):
        return
    fn = dispatch.load(next(iter(impls)))
    for module in model.modules():
        if hasattr(module, "_skyrl_linear_fn"):
            prepare_linear(module, fn)


def route_model(model: torch.nn.Module, ledger: Any, routed: dict[str, list[str]], classes: LayerClasses,
                extra: Callable[[OpDispatch, PatchRecord], None] | None = None, **meta: Any) -> OpDispatch:
    """Route ``model``'s layers (``route_layers``) through ``ledger``, let the engine route what else
    it has (``extra(dispatch, record)``, e.g. a sampler), record what was claimed and refused in
    ``ledger.meta`` (with ``routed`` and ``meta``) and attach the ledger as ``_skyrl_op_ledger``
    unless a plugin attached its own; return the model's dispatch."""
    from skyrl_core.ops.dispatch import attach_dispatch

    dispatch = attach_dispatch(model, ledger) or model._skyrl_dispatch
    record = route_layers(model, dispatch, routed, classes)
    _prepare_linears(model, dispatch, ledger)
    if extra is not None:
        extra(dispatch, record)
    record.finish(ledger, architecture=type(model).__name__, routed={op: names for op, names in sorted(routed.items())}, **meta)
    if getattr(model, "_skyrl_op_ledger", None) is None:
        model._skyrl_op_ledger = ledger
    return dispatch
