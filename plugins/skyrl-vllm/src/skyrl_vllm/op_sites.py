"""Op sites in vLLM's layers: each layer that computes an op calls the implementation installed at
the current site (``skyrl_core.ops``), the way ``skyrl_core.ops.hf`` routes a transformers model and
``skyrl_megatron.ops_sites`` routes megatron-core.

``install`` runs once in every vLLM process skyrl starts (``skyrl_vllm.bootstrap``). It wraps the
model runner's ``load_model``, which offers each load's two moments to every plugin (the
``skyrl_engine_model_loading`` hook with vLLM's config before the model is built, then
``skyrl_engine_model_loaded`` with the built, routed model; no other plugin wraps vLLM's runner).
Before vLLM builds a model, the engine's ops are installed through
``prepare_model(None, "engine")`` (the ``skyrl_install_op`` hook, which plugins wrap). An op is
*routed* when a non-stock implementation is installed at one of the engine sites and no plugin
computes it with its own vLLM layers (``skyrl_core.ops.engine_forms``). Nothing routed and no
plugin's own layers (the usual case) means nothing is patched: vLLM runs its own classes and
kernels, at no cost. Otherwise the built model's layers are routed per instance, and every call
asks the model's ``OpDispatch`` (``skyrl_core.ops.dispatch``) for the implementation at the
current site (the routed forwards are ``skyrl_core.ops.engine_layers``, shared with skyrl-sglang).
IsoExec is such a plugin: its canonical linear, embedding, norm, SiLU, rotary and logprobs reach
vLLM through this table; its attention, MoE and GatedDeltaNet are its own layers.

===================================  ==========  ====================================================
vLLM layer                           op          routed call (calling conventions: ``skyrl_core.ops.hf``)
===================================  ==========  ====================================================
``UnquantizedLinearMethod.apply``    linear      ``fn(x, weight, bias)`` on the plain ``[N, K]`` weight
                                                 (kept: vLLM-CPU would prepack it and empty the
                                                 Parameter); merged q/k/v and gate/up split by
                                                 ``output_partition_sizes``, one call per piece,
                                                 unless ``fn.columns_independent``; fp32 weights
                                                 prepacked for oneDNN when ``fn`` gives the same
                                                 bits from them (``onednn.prepack_if_same_bits``),
                                                 built at load for the installed linear, rebuilt
                                                 after each in-place weight reload
``UnquantizedEmbeddingMethod.apply`` linear      lm_head over the ``org_vocab_size`` real rows, padded;
                                                 prepacked as a linear (a tied one rebuilt on reload)
``UnquantizedEmbeddingMethod.embedding`` embedding ``fn(ids, weight, None)``
``RMSNorm`` / ``GemmaRMSNorm``       rms_norm    ``residual + x`` rounded to the model dtype first (the
                                                 trainer's residual add), then ``fn(x, w, eps,
                                                 unit_offset, None)``
``RMSNormGated``                     rms_norm    ``fn(x, w, eps, False, z)`` (one group, norm before gate)
``SiluAndMul``                       silu_mul    ``fn(gate, up)``
``RotaryEmbedding`` (neox style)     rope        cos/sin from ``fn(inv_freq, 1.0, positions, dtype)``
                                                 (kept while the positions repeat), applied as
                                                 transformers does
``Sampler.compute_logprobs``         logprobs    ``fn.full_log_softmax(logits)`` (vLLM gathers from the
                                                 full ``[rows, vocab]`` matrix)
===================================  ==========  ====================================================

Attention, MoE and GatedDeltaNet compute over vLLM's own state (the paged KV cache, merged expert
weights, the recurrent state cache): an implementation of those ops reaches vLLM only with its own
vLLM layers (declared in ``engine_forms``); a routed one without them refuses the model. A layer
computing a routed op that has no mapping here (another rotary class, a quantized linear) is
listed in ``ledger.meta["unpatched"]``.

Sites: each step is ``engine_decode`` when every scheduled request has one query token, else
``engine_prefill`` (``execute_model`` and ``sample_tokens`` run inside that ``site_scope``; a
plugin's own layers read it too). vLLM's dummy runs (memory profiling, warm-up) compute no request:
they run the stock path (``F.linear`` on a layer whose weight was kept plain) and are left out of
the ledger; any other call outside a step is observed as unscoped. The ledger, with calls per
site, is the model's ``_skyrl_op_ledger`` (what ``skyrl_attest`` returns); a plugin with its own
layers adds to it from ``skyrl_engine_model_loaded`` (IsoExec does, before the KV cache is set up). A
rotary module vLLM shares between models built in one process is not reused once routed.
"""

from __future__ import annotations

import functools
from typing import Any, Callable

import torch

from skyrl_core.engines import bootstrap
from skyrl_core.ops import engine_forms, engine_layers
from skyrl_core.ops.dispatch import OpDispatch
from skyrl_core.ops.ledger import OpLedger
from skyrl_core.ops.vocabulary import site_scope

ENGINE = "vllm"
# Ops that compute over vLLM's own state: reachable only through a plugin's own vLLM layers.
OWN_LAYERS_ONLY = ("attention", "moe_router", "moe_experts", "moe_combine", "gdn_conv", "gdn_core")

_wrapped: dict[tuple[type, str], Callable[..., Any]] = {}
_keep_plain_linear = [False]  # True while a model whose linears are routed is being loaded
_routing = [True]  # False: load_model offers its moments to the plugins but routes nothing


def routed_ops(ledger: OpLedger) -> dict[str, list[str]]:
    """Op -> names of the non-stock implementations this engine's layers must call (empty: none)."""
    return engine_forms.routed_ops(ledger, ENGINE)


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
        _prepare_again(layer)

    return process_weights_after_loading


def _reprepare_lm_head(original: Callable[..., Any]) -> Callable[..., Any]:
    """vLLM's embedding method keeps the plain weight (its CPU kernel's packed copy is extra); a
    routed lm_head's own packed copy is rebuilt after each (re)load, a tied one's included."""

    @functools.wraps(original)
    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        original(self, layer)
        _prepare_again(layer)

    return process_weights_after_loading


def _prepare_again(layer: torch.nn.Module) -> None:
    fn = getattr(layer, "_skyrl_linear_fn", None)
    if fn is not None:
        engine_layers.prepare_linear(layer, fn)  # the packed copy of the old weight is stale


# --- the model walk --------------------------------------------------------------------------------


def layer_classes() -> engine_layers.LayerClasses:
    """vLLM's classes for each routed layer shape."""
    from vllm.model_executor.layers.activation import SiluAndMul
    from vllm.model_executor.layers.layernorm import GemmaRMSNorm, RMSNorm, RMSNormGated
    from vllm.model_executor.layers.linear import LinearBase, UnquantizedLinearMethod
    from vllm.model_executor.layers.rotary_embedding.base import RotaryEmbedding, RotaryEmbeddingBase
    from vllm.model_executor.layers.vocab_parallel_embedding import (
        ParallelLMHead,
        UnquantizedEmbeddingMethod,
        VocabParallelEmbedding,
    )

    return engine_layers.LayerClasses(
        linear=LinearBase, linear_method=UnquantizedLinearMethod, embedding=VocabParallelEmbedding, lm_head=ParallelLMHead,
        embedding_method=UnquantizedEmbeddingMethod, rms_norm=(RMSNorm,), unit_offset_norm=(GemmaRMSNorm,), gated_norm=(RMSNormGated,),
        silu_mul=(SiluAndMul,), rotary=(RotaryEmbeddingBase,),
        # the default rotary only (an out-of-tree subclass that keeps its arithmetic counts as it)
        plain_rotary=lambda m: isinstance(m, RotaryEmbedding) and type(m).forward_native is RotaryEmbedding.forward_native,
        # vLLM-CPU empties prepacked weights: only a layer whose weight was kept plain can be routed
        plain_weight=lambda m: getattr(m, "_skyrl_plain", False),
    )


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
    for name in ("_dummy_run", "_dummy_sampler_run"):
        if hasattr(runner, name):
            setattr(runner, name, _unobserved(runner, getattr(runner, name)))


def _unobserved(runner: Any, dummy_run: Callable[..., Any]) -> Callable[..., Any]:
    """vLLM's dummy runs (memory profiling, warm-up) compute no request: what they call, outside
    any step, is left out of the ledger (a real call outside a step stays visible there)."""

    @functools.wraps(dummy_run)
    def run(*args, **kwargs):
        ledger = runner.model._skyrl_dispatch.ledger
        observed, ran = ledger.observed.copy(), set(ledger.ran_modules)
        try:
            return dummy_run(*args, **kwargs)
        finally:
            ledger.observed.clear()
            ledger.observed.update(observed)
            ledger.ran_modules.clear()
            ledger.ran_modules.update(ran)

    return run


def route_model(runner: Any, ledger: OpLedger, routed: dict[str, list[str]]) -> None:
    """Route the runner's freshly built model (and its sampler, and its steps' sites) through ``ledger``."""

    def route_sampler(dispatch, record):
        if "logprobs" in routed:
            _route_sampler(runner, dispatch)
            record.counts["logprobs"] = 1

    engine_layers.route_model(runner.model, ledger, routed, layer_classes(), route_sampler,
                              dtype=str(runner.vllm_config.model_config.dtype).removeprefix("torch."))
    _name_sites(runner)


def _wrap_load_model(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def load_model(self, *args, **kwargs):
        if _routing[0]:
            load = functools.partial(_load_and_route, self, original, *args, **kwargs)
        else:
            load = functools.partial(original, self, *args, **kwargs)
        return bootstrap.load_model(ENGINE, self.vllm_config, load, lambda: self.model)

    return load_model


def _load_and_route(runner: Any, original: Callable[..., Any], *args, **kwargs) -> Any:
    """``original`` load, with the model's layers routed through the engine's installed ops."""
    from skyrl_core.ops import prepare_model

    ledger = prepare_model(None, "engine")
    routed = routed_ops(ledger)
    problems = refusals(routed)
    if problems:
        raise ValueError("skyrl cannot route vLLM's layers through the installed ops: " + "; ".join(problems))
    _forget_routed_rotary_embeddings()
    if not routed and not engine_forms.own_layer_impls(ledger, ENGINE):
        return original(runner, *args, **kwargs)
    if "linear" in routed:
        linear_method, embedding_method = _linear_method_classes()
        _wrap_once(linear_method, "process_weights_after_loading", _keep_plain_processing)
        _wrap_once(embedding_method, "process_weights_after_loading", _reprepare_lm_head)
    _keep_plain_linear[0] = "linear" in routed
    try:
        result = original(runner, *args, **kwargs)
    finally:
        _keep_plain_linear[0] = False
    route_model(runner, ledger, routed)
    return result


def _linear_method_classes() -> tuple[type, type]:
    from vllm.model_executor.layers.linear import UnquantizedLinearMethod
    from vllm.model_executor.layers.vocab_parallel_embedding import UnquantizedEmbeddingMethod

    return UnquantizedLinearMethod, UnquantizedEmbeddingMethod


def _forget_routed_rotary_embeddings() -> None:
    """vLLM shares rotary modules between the models built in one process (``get_rope``'s cache):
    one routed for an earlier model (its forward bound to that model's dispatch) is not reused."""
    from vllm.model_executor.layers.rotary_embedding import _ROPE_DICT

    for key, module in list(_ROPE_DICT.items()):
        if getattr(module, "_skyrl_dispatch", None) is not None:
            del _ROPE_DICT[key]


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


def install(route: bool = True) -> None:
    """Wrap the model runner's ``load_model`` in this process (idempotent): each load offers its
    two moments to the plugins (``skyrl_engine_model_loading`` with vLLM's config, then
    ``skyrl_engine_model_loaded`` with the built model) and, with ``route``, routes the model's
    layers in between. Costs nothing per step: a model is routed only when a non-stock
    implementation is installed when it is loaded. ``route=False`` (``SKYRL_VLLM_OP_SITES=0``)
    leaves every model's layers as vLLM built them."""
    _routing[0] = route
    for runner in _runner_classes():
        _wrap_once(runner, "load_model", _wrap_load_model)


def uninstall() -> None:
    """Restore vLLM's own methods in this process (tests)."""
    for (cls, name), original in list(_wrapped.items()):
        setattr(cls, name, original)
        del _wrapped[(cls, name)]
