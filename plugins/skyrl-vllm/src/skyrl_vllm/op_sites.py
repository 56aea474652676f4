"""Op sites in vLLM's layers: each layer that computes an op calls the implementation installed at
the current site (``skyrl_core.ops``), the way ``skyrl_core.ops.hf`` routes a transformers model and
``skyrl_megatron.ops_sites`` routes megatron-core.

``install`` runs once in every vLLM process skyrl starts (``skyrl_vllm.bootstrap``). It wraps the
model runner's ``load_model``: before vLLM builds a model, the engine's ops are installed through
``prepare_model(None, "engine")`` (the ``skyrl_install_op`` hook, which plugins wrap). An op is
*routed* when a non-stock implementation is installed at one of the engine sites and no plugin
computes it with its own vLLM layers (``skyrl_core.ops.engine_forms``). Nothing routed (the
usual case) means nothing is patched: vLLM runs its own classes and kernels, at no cost. Otherwise
the built model's layers are routed per instance, and every call asks the model's ``OpDispatch``
(``skyrl_core.ops.dispatch``) for the implementation at the current site:

===================================  ==========  ====================================================
vLLM layer                           op          routed call (calling conventions: ``skyrl_core.ops.hf``)
===================================  ==========  ====================================================
``UnquantizedLinearMethod.apply``    linear      ``fn(x, weight, bias)`` on the plain ``[N, K]`` weight
                                                 (kept: vLLM-CPU would prepack it and empty the
                                                 Parameter); merged q/k/v and gate/up split by
                                                 ``output_partition_sizes``, one call per piece,
                                                 unless ``fn.columns_independent``; fp32 weights
                                                 prepacked for oneDNN when ``fn`` gives the same
                                                 bits from them (``onednn.prepack_if_same_bits``)
``UnquantizedEmbeddingMethod.apply`` linear      lm_head over the ``org_vocab_size`` real rows, padded
``UnquantizedEmbeddingMethod.embedding`` embedding ``fn(ids, weight, None)``
``RMSNorm`` / ``GemmaRMSNorm``       rms_norm    ``residual + x`` rounded to the model dtype first (the
                                                 trainer's residual add), then ``fn(x, w, eps,
                                                 unit_offset, None)``
``RMSNormGated``                     rms_norm    ``fn(x, w, eps, False, z)`` (one group, norm before gate)
``SiluAndMul``                       silu_mul    ``fn(gate, up)``
``RotaryEmbedding`` (neox style)     rope        cos/sin from ``fn(inv_freq, 1.0, positions, dtype)``,
                                                 applied as transformers does
``Sampler.compute_logprobs``         logprobs    ``fn.full_log_softmax(logits)`` (vLLM gathers from the
                                                 full ``[rows, vocab]`` matrix)
===================================  ==========  ====================================================

Attention, MoE and GatedDeltaNet compute over vLLM's own state (the paged KV cache, merged expert
weights, the recurrent state cache): an implementation of those ops reaches vLLM only with its own
vLLM layers (declared in ``engine_forms``); a routed one without them refuses the model. A layer
computing a routed op that has no mapping here (another rotary class, a quantized linear) is
listed in ``ledger.meta["unpatched"]``.

Sites: each step is ``engine_decode`` when every scheduled request has one query token, else
``engine_prefill`` (``execute_model`` and ``sample_tokens`` run inside that ``site_scope``). Calls
outside any step (vLLM's warm-up) are observed as unscoped and computed by the stock path; a layer
whose weight was kept plain computes ``F.linear`` there. The ledger, with calls per site, is the
model's ``_skyrl_op_ledger`` (what ``skyrl_attest`` returns), unless a plugin attached its own.
"""

from __future__ import annotations

import functools
from typing import Any, Callable

import torch
import torch.nn.functional as F

from skyrl_core.ops import onednn
from skyrl_core.ops.dispatch import OpDispatch, PatchRecord, attach_dispatch
from skyrl_core.ops.engine_forms import own_layers_owner
from skyrl_core.ops.ledger import OpLedger
from skyrl_core.ops.rotary import default_inv_freq
from skyrl_core.ops.stock import is_stock
from skyrl_core.ops.vocabulary import ROLE_SITES, site_scope

ENGINE = "vllm"
# Ops that compute over vLLM's own state: reachable only through a plugin's own vLLM layers.
OWN_LAYERS_ONLY = ("attention", "moe_router", "moe_experts", "moe_combine", "gdn_conv", "gdn_core")

_wrapped: dict[tuple[type, str], Callable[..., Any]] = {}
_keep_plain_linear = [False]  # True while a model whose linears are routed is being loaded


def routed_ops(ledger: OpLedger) -> dict[str, list[str]]:
    """Op -> names of the non-stock implementations vLLM's layers must call for it (empty: none)."""
    routed: dict[str, list[str]] = {}
    for site in ROLE_SITES["engine"]:
        for (op, at), impl in ledger.declared.items():
            if at == site and not is_stock(impl) and own_layers_owner(ENGINE, impl.name) is None:
                names = routed.setdefault(op, [])
                if impl.name not in names:
                    names.append(impl.name)
    return routed


def refusals(routed: dict[str, list[str]]) -> list[str]:
    """Why vLLM's layers cannot call ``routed``'s implementations, one sentence each."""
    return [
        f"{op} implementation {', '.join(names)} has no vLLM layers of its own: vLLM computes {op} over its own "
        "state (paged KV cache, merged experts, recurrent state cache), which the op's calling convention does not "
        "carry (declare its vLLM layers with skyrl_core.ops.engine_forms, or keep vLLM's own kernel)"
        for op, names in routed.items() if op in OWN_LAYERS_ONLY
    ]


# --- linear ----------------------------------------------------------------------------------------


def _keep_plain_processing(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        if not (_keep_plain_linear[0] or getattr(layer, "_skyrl_plain", False)):
            return original(self, layer)
        layer._skyrl_plain = True  # kept for in-place reloads, which process the layer again
        fn = getattr(layer, "_skyrl_linear_fn", None)
        if fn is not None:
            _prepare_linear(layer, fn)  # the packed copy of the old weight is stale

    return process_weights_after_loading


def _pieces(layer: torch.nn.Module, fn: Callable[..., Any]) -> tuple[int, ...]:
    rows = int(layer.weight.shape[0])
    sizes = tuple(int(n) for n in getattr(layer, "output_partition_sizes", ()) or ())
    if len(sizes) < 2 or sum(sizes) != rows or getattr(fn, "columns_independent", False):
        return (rows,)
    return sizes


def _prepare_linear(layer: torch.nn.Module, fn: Callable[..., Any]) -> None:
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
        _prepare_linear(layer, fn)
    pieces, weight = layer._skyrl_pieces, layer.weight
    if len(pieces) == 1:
        return fn(x, weight if layer._skyrl_packed is None else layer._skyrl_packed, bias)
    outputs, start = [], 0
    for rows in pieces:
        outputs.append(fn(x, weight.narrow(0, start, rows), None if bias is None else bias.narrow(0, start, rows)))
        start += rows
    return torch.cat(outputs, dim=-1)


def _routed_linear_apply(layer: torch.nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``UnquantizedLinearMethod.apply`` of a routed layer (set on its method instance)."""
    return layer._skyrl_dispatch.call(
        "linear", layer, lambda: F.linear(x, layer.weight, bias), lambda fn: _run_linear(fn, layer, x, bias)
    )


def _lm_head_logits(fn: Callable[..., Any], layer: torch.nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    if fn is not layer._skyrl_linear_fn:
        _prepare_linear(layer, fn)
    vocab, packed = layer._skyrl_vocab, layer._skyrl_packed
    logits = fn(x, layer.weight.narrow(0, 0, vocab) if packed is None else packed, None if bias is None else bias.narrow(0, 0, vocab))
    padded = int(layer.weight.shape[0])
    return logits if padded == vocab else F.pad(logits, (0, padded - vocab))  # vLLM's padding, cut by LogitsProcessor


def _routed_lm_head_apply(layer: torch.nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``UnquantizedEmbeddingMethod.apply`` of a routed lm_head (set on its method instance)."""
    stock = type(layer.quant_method).apply
    return layer._skyrl_dispatch.call(
        "linear", layer, lambda: stock(layer.quant_method, layer, x, bias), lambda fn: _lm_head_logits(fn, layer, x, bias)
    )


def _routed_embedding(layer: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    """``UnquantizedEmbeddingMethod.embedding`` of a routed input embedding."""
    stock = type(layer.quant_method).embedding
    return layer._skyrl_dispatch.call(
        "embedding", layer, lambda: stock(layer.quant_method, layer, ids), lambda fn: fn(ids, layer.weight, None)
    )


# --- norms, activation, rotary ---------------------------------------------------------------------


def _rms_norm_forward(module, x, residual=None):
    weight = module.weight if getattr(module, "has_weight", True) else torch.ones_like(module.weight)

    def installed(fn):
        if residual is None:
            return fn(x, weight, float(module.variance_epsilon), module._skyrl_unit_offset, None)
        summed = residual + x  # the trainer's residual add, rounded to the model dtype
        return fn(summed, weight, float(module.variance_epsilon), module._skyrl_unit_offset, None), summed

    return module._skyrl_dispatch.call("rms_norm", module, lambda: module._skyrl_stock_forward(x, residual), installed)


def _gated_norm_forward(module, x, z=None):
    return module._skyrl_dispatch.call(
        "rms_norm", module, lambda: module._skyrl_stock_forward(x, z), lambda fn: fn(x, module.weight, float(module.eps), False, z)
    )


def _silu_mul_forward(module, x):
    d = x.shape[-1] // 2
    return module._skyrl_dispatch.call("silu_mul", module, lambda: module._skyrl_stock_forward(x), lambda fn: fn(x[..., :d], x[..., d:]))


def _rotate(module, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """transformers' ``x * cos + rotate_half(x) * sin`` on the first ``rotary_dim`` channels."""
    shape = x.shape
    x = x.view(cos.shape[0], -1, module.head_size)
    rot = x[..., : module.rotary_dim]
    half = module.rotary_dim // 2
    rotated = rot * cos + torch.cat((-rot[..., half:], rot[..., :half]), dim=-1) * sin
    if module.rotary_dim != module.head_size:
        rotated = torch.cat((rotated, x[..., module.rotary_dim:]), dim=-1)
    return rotated.reshape(shape)


def _rope_forward(module, positions, query, key=None):
    def installed(fn):
        cos, sin = fn(module._skyrl_inv_freq, 1.0, positions.flatten().unsqueeze(0), query.dtype)
        cos, sin = cos[0].unsqueeze(1), sin[0].unsqueeze(1)  # [T, 1, rotary_dim]: broadcast over heads
        return _rotate(module, query, cos, sin), None if key is None else _rotate(module, key, cos, sin)

    return module._skyrl_dispatch.call("rope", module, lambda: module._skyrl_stock_forward(positions, query, key), installed)


# --- the model walk --------------------------------------------------------------------------------


def _route_layers(model: torch.nn.Module, dispatch: OpDispatch, routed: dict[str, list[str]]) -> PatchRecord:
    from vllm.model_executor.layers.activation import SiluAndMul
    from vllm.model_executor.layers.layernorm import GemmaRMSNorm, RMSNorm, RMSNormGated
    from vllm.model_executor.layers.linear import LinearBase, UnquantizedLinearMethod
    from vllm.model_executor.layers.rotary_embedding.base import RotaryEmbedding, RotaryEmbeddingBase
    from vllm.model_executor.layers.vocab_parallel_embedding import (
        ParallelLMHead,
        UnquantizedEmbeddingMethod,
        VocabParallelEmbedding,
    )

    record = PatchRecord(dispatch)
    for qualname, module in model.named_modules():
        method = getattr(module, "quant_method", None)
        if isinstance(module, LinearBase) and "linear" in routed:
            if isinstance(method, UnquantizedLinearMethod) and getattr(module, "_skyrl_plain", False):
                module._skyrl_linear_fn = None
                record.claim(module, qualname, "linear")
                method.apply = _routed_linear_apply
            else:
                record.refuse(qualname, type(module).__name__)
        elif isinstance(module, VocabParallelEmbedding) and isinstance(method, UnquantizedEmbeddingMethod):
            if isinstance(module, ParallelLMHead) and "linear" in routed:
                module._skyrl_vocab = int(getattr(module, "org_vocab_size", module.weight.shape[0]))
                module._skyrl_linear_fn = None
                record.claim(module, qualname, "linear")
                method.apply = _routed_lm_head_apply
            elif not isinstance(module, ParallelLMHead) and "embedding" in routed:
                record.claim(module, qualname, "embedding")
                method.embedding = _routed_embedding
        elif isinstance(module, RMSNormGated) and "rms_norm" in routed:
            if module.group_size not in (None, module.weight.shape[-1]) or not module.norm_before_gate or module.activation not in ("silu", "swish"):
                record.refuse(qualname, type(module).__name__)
            else:
                record.claim(module, qualname, "rms_norm", _gated_norm_forward)
        elif isinstance(module, (RMSNorm, GemmaRMSNorm)) and "rms_norm" in routed:
            if getattr(module, "variance_size_override", None) is not None:
                record.refuse(qualname, type(module).__name__)
            else:
                module._skyrl_unit_offset = isinstance(module, GemmaRMSNorm)
                record.claim(module, qualname, "rms_norm", _rms_norm_forward)
        elif isinstance(module, SiluAndMul) and "silu_mul" in routed:
            record.claim(module, qualname, "silu_mul", _silu_mul_forward)
        elif isinstance(module, RotaryEmbeddingBase) and "rope" in routed:
            if isinstance(module, RotaryEmbedding) and type(module).forward_native is RotaryEmbedding.forward_native and module.is_neox_style:
                module._skyrl_inv_freq = default_inv_freq(module.base, module.rotary_dim)
                record.claim(module, qualname, "rope", _rope_forward)
            else:  # scaled / multimodal / interleaved rotary: no mapping onto the op's convention
                record.refuse(qualname, type(module).__name__)
    return record


def _route_sampler(runner: Any, dispatch: OpDispatch) -> None:
    stock = runner.sampler.compute_logprobs
    fns = {}

    def full(fn):
        form = getattr(fn, "full_log_softmax", None)
        if form is None:
            raise ValueError(
                f"logprobs implementation {fn!r} has no full_log_softmax(logits) form: vLLM's sampler gathers "
                "every logprob it returns from the full [rows, vocab] matrix"
            )
        return fns.setdefault(id(fn), form)

    def compute_logprobs(logits: torch.Tensor) -> torch.Tensor:
        return dispatch.call("logprobs", None, lambda: stock(logits), lambda fn: full(fn)(logits))

    runner.sampler.compute_logprobs = compute_logprobs


def _name_sites(runner: Any) -> None:
    """Run each step (its forward and its sampling) inside its op site's ``site_scope``."""
    execute, sample = runner.execute_model, runner.sample_tokens
    runner._skyrl_site = "engine_prefill"

    def execute_model(scheduler_output, *args, **kwargs):
        counts = scheduler_output.num_scheduled_tokens
        runner._skyrl_site = "engine_decode" if counts and all(n == 1 for n in counts.values()) else "engine_prefill"
        with site_scope(runner._skyrl_site):
            return execute(scheduler_output, *args, **kwargs)

    def sample_tokens(*args, **kwargs):
        with site_scope(runner._skyrl_site):
            return sample(*args, **kwargs)

    runner.execute_model, runner.sample_tokens = execute_model, sample_tokens


def route_model(runner: Any, ledger: OpLedger, routed: dict[str, list[str]]) -> None:
    """Route the runner's freshly built model (and its sampler, and its steps' sites) through ``ledger``."""
    model = runner.model
    dispatch = attach_dispatch(model, ledger) or model._skyrl_dispatch
    record = _route_layers(model, dispatch, routed)
    if "logprobs" in routed:
        _route_sampler(runner, dispatch)
        record.counts["logprobs"] = 1
    _name_sites(runner)
    record.finish(ledger, architecture=type(model).__name__, dtype=str(runner.vllm_config.model_config.dtype).removeprefix("torch."),
                  routed={op: names for op, names in sorted(routed.items())})
    if getattr(model, "_skyrl_op_ledger", None) is None:
        model._skyrl_op_ledger = ledger


def _wrap_load_model(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def load_model(self, *args, **kwargs):
        from skyrl_core.ops import prepare_model

        ledger = prepare_model(None, "engine")
        routed = routed_ops(ledger)
        problems = refusals(routed)
        if problems:
            raise ValueError("skyrl cannot route vLLM's layers through the installed ops: " + "; ".join(problems))
        if not routed:
            return original(self, *args, **kwargs)
        if "linear" in routed:
            _wrap_once(_linear_method_class(), "process_weights_after_loading", _keep_plain_processing)
        _keep_plain_linear[0] = "linear" in routed
        try:
            result = original(self, *args, **kwargs)
        finally:
            _keep_plain_linear[0] = False
        route_model(self, ledger, routed)
        return result

    return load_model


def _linear_method_class() -> type:
    from vllm.model_executor.layers.linear import UnquantizedLinearMethod

    return UnquantizedLinearMethod


def _wrap_once(cls: type, name: str, wrapper: Callable[[Callable[..., Any]], Callable[..., Any]]) -> None:
    if (cls, name) not in _wrapped:
        _wrapped[(cls, name)] = cls.__dict__[name]
        setattr(cls, name, wrapper(getattr(cls, name)))


def _runner_classes() -> list[type]:
    from vllm.platforms import current_platform

    if current_platform.is_cpu():
        from vllm.v1.worker.cpu_model_runner import CPUModelRunner

        return [CPUModelRunner]
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    return [GPUModelRunner]


def install() -> None:
    """Wrap the model runner's ``load_model`` in this process (idempotent). Costs nothing per step:
    a model is routed only when a non-stock implementation is installed when it is loaded."""
    for runner in _runner_classes():
        _wrap_once(runner, "load_model", _wrap_load_model)


def uninstall() -> None:
    """Restore vLLM's own methods in this process (tests)."""
    for (cls, name), original in list(_wrapped.items()):
        setattr(cls, name, original)
        del _wrapped[(cls, name)]
