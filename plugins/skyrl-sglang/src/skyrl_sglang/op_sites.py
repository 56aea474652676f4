"""Op sites in SGLang's layers: each layer that computes an op calls the implementation installed at
the current site (``skyrl_core.ops``), as ``skyrl_vllm.op_sites`` does for vLLM (SGLang's layers
have vLLM's shapes, so the routed forwards are the same: ``skyrl_core.ops.engine_layers``).

``install`` runs once in every SGLang process skyrl starts (``skyrl_sglang.bootstrap``) and wraps
``ModelRunner.load_model`` (between the model-load hooks ``skyrl_engine_model_loading``, with
SGLang's ``ServerArgs``, and ``skyrl_engine_model_loaded``: ``skyrl_core.engines.bootstrap.load_model``):
the engine's ops are installed through ``prepare_model(None, "engine")``
(the ``skyrl_install_op`` hook) before the model is built; with only stock implementations nothing
is patched. Otherwise the built model's linear/lm_head/embedding methods, RMSNorm and GemmaRMSNorm,
SiluAndMul and the default RotaryEmbedding call the installed implementation, and each
``ModelRunner.forward`` runs in ``engine_decode`` (a decode batch) or ``engine_prefill``.

Not routed, hence refused when a non-stock implementation is installed: attention, MoE and
GatedDeltaNet (SGLang computes them over its own KV pool and state; no plugin brings SGLang layers
of its own yet) and logprobs (SGLang computes them in several places of its logits processor and
sampler). CUDA graphs replay kernels without calling Python: a routed model needs
``disable_cuda_graph`` (refused otherwise). SGLang cannot start without CUDA, so the routing is
tested here on stand-ins for its layer classes (``tests/test_sglang_op_sites.py``); the GPU test
runs it in a real SGLang.
"""

from __future__ import annotations

import functools
from typing import Any, Callable

from skyrl_core.engines import bootstrap
from skyrl_core.ops import engine_forms, engine_layers
from skyrl_core.ops.ledger import OpLedger
from skyrl_core.ops.vocabulary import site_scope

ENGINE = "sglang"
ROUTABLE = ("embedding", "linear", "rms_norm", "rope", "silu_mul")

_wrapped: dict[tuple[type, str], Callable[..., Any]] = {}


def routed_ops(ledger: OpLedger) -> dict[str, list[str]]:
    """Op -> names of the non-stock implementations this engine's layers must call (empty: none)."""
    return engine_forms.routed_ops(ledger, ENGINE)


def refusals(routed: dict[str, list[str]], *, cuda_graph: bool) -> list[str]:
    """Why SGLang's layers cannot call ``routed``'s implementations, one sentence each."""
    problems = [
        f"{op} implementation {', '.join(names)} cannot be called from SGLang's layers (skyrl routes only "
        f"{', '.join(ROUTABLE)} inside SGLang)"
        for op, names in routed.items() if op not in ROUTABLE
    ]
    if routed and cuda_graph:
        problems.append("CUDA graphs replay SGLang's kernels without calling the installed implementations "
                        "(set disable_cuda_graph)")
    return problems


def layer_classes() -> engine_layers.LayerClasses:
    """SGLang's classes for each routed layer shape."""
    from sglang.srt.layers.activation import SiluAndMul
    from sglang.srt.layers.layernorm import GemmaRMSNorm, RMSNorm
    from sglang.srt.layers.linear import LinearBase
    from sglang.srt.layers.quantization.unquant import UnquantizedEmbeddingMethod, UnquantizedLinearMethod
    from sglang.srt.layers.rotary_embedding import RotaryEmbedding
    from sglang.srt.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding

    return engine_layers.LayerClasses(
        linear=LinearBase, linear_method=UnquantizedLinearMethod, embedding=VocabParallelEmbedding, lm_head=ParallelLMHead,
        embedding_method=UnquantizedEmbeddingMethod, rms_norm=(RMSNorm,), unit_offset_norm=(GemmaRMSNorm,), gated_norm=(),
        silu_mul=(SiluAndMul,), rotary=(RotaryEmbedding,), plain_rotary=lambda m: type(m) is RotaryEmbedding,
        plain_weight=lambda m: True,  # SGLang keeps the plain weight of an unquantized linear
    )


def _name_sites(runner: Any) -> None:
    forward = runner.forward

    def routed_forward(forward_batch, *args, **kwargs):
        site = "engine_decode" if forward_batch.forward_mode.is_decode() else "engine_prefill"
        with site_scope(site):
            return forward(forward_batch, *args, **kwargs)

    runner.forward = routed_forward


def route_model(runner: Any, ledger: OpLedger, routed: dict[str, list[str]], classes: engine_layers.LayerClasses) -> None:
    """Route the runner's freshly built model (and its steps' sites) through ``ledger``."""
    engine_layers.route_model(runner.model, ledger, routed, classes)
    _name_sites(runner)


def _wrap_load_model(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def load_model(self, *args, **kwargs):
        load = functools.partial(_load_and_route, self, original, *args, **kwargs)
        return bootstrap.load_model(ENGINE, self.server_args, load, lambda: self.model)

    return load_model


def _load_and_route(runner: Any, original: Callable[..., Any], *args, **kwargs) -> Any:
    """``original`` load, with the model's layers routed through the engine's installed ops."""
    from skyrl_core.ops import prepare_model

    ledger = prepare_model(None, "engine")
    routed = routed_ops(ledger)
    if not routed:
        return original(runner, *args, **kwargs)
    problems = refusals(routed, cuda_graph=not getattr(runner.server_args, "disable_cuda_graph", False))
    if problems:
        raise ValueError("skyrl cannot route SGLang's layers through the installed ops: " + "; ".join(problems))
    result = original(runner, *args, **kwargs)
    route_model(runner, ledger, routed, layer_classes())
    return result


def install() -> None:
    """Wrap ``ModelRunner.load_model`` in this process (idempotent; nothing per step)."""
    from sglang.srt.model_executor.model_runner import ModelRunner

    if (ModelRunner, "load_model") not in _wrapped:
        _wrapped[(ModelRunner, "load_model")] = ModelRunner.__dict__["load_model"]
        ModelRunner.load_model = _wrap_load_model(ModelRunner.load_model)
