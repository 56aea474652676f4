"""Installing IsoExec into vLLM in the current process (idempotent).

Runs from ``skyrl_worker_init(role="engine", engine="vllm")``, which skyrl's vLLM bootstrap calls in
every vLLM process it starts (front-end, engine core, each worker) before any model is built, after
it installed skyrl-vllm's op sites (``skyrl_vllm.op_sites``). Linear, lm_head, embedding, the norms,
SiLU-and-mul, rotary and the sampler's logprobs need nothing here: IsoExec's ``skyrl_install_op``
hook installs its canonical implementations and vLLM's op sites call them. What computes over
vLLM's own state is IsoExec's own layers (declared with ``skyrl_core.ops.engine_forms``):

1. ``register_oot`` for the MoE block's ``MoERunner`` and ``UnquantizedFusedMoEMethod``
   (``moe.REPLACEMENTS``) and for ``QwenGatedDeltaNetAttention`` (``gdn.REPLACEMENTS``);
2. the ``CPU_ATTN`` attention backend (``attention.install``; vLLM's ``CUSTOM`` slot elsewhere);
3. two checkpoints: vLLM's config is checked in the front-end (``EngineArgs.create_engine_config``)
   and in the worker when skyrl-vllm's model load announces it (``skyrl_engine_model_loading``:
   ``model_loading``), and the model the worker built and skyrl-vllm routed is inspected when the
   load reports it (``skyrl_engine_model_loaded``: ``model_loaded``), before its KV cache and
   attention backends are set up: anything IsoExec cannot make identical is refused with one
   sentence, and the model's op ledger (``_skyrl_op_ledger``, where skyrl's worker attestation RPC
   reads it) gets IsoExec's own layers' modules and what is installed. IsoExec wraps none of
   vLLM's model-runner methods: the load's two moments are skyrl-vllm's to offer.

Everything installed is inert for modules built while IsoExec is off: each replacement decides
when its module is built and otherwise runs vLLM's own code. So skyrl installs it in every vLLM
process it starts, on or off: an in-process engine (one Python process for trainer and vLLM,
whose plugins vLLM loads only once) can then be built with IsoExec on after one built with it
off, and the reverse.
"""

from __future__ import annotations

import functools
from typing import Any, Callable

from skyrl_core.ops import engine_forms

from skyrl_isoexec.specs import CANONICAL
from skyrl_isoexec.vllm import attention, checks, gdn, moe, runtime

# The canonical ops IsoExec computes inside vLLM with its own layers (the others go through vLLM's op sites).
OWN_LAYER_OPS = ("attention", "moe_router", "moe_experts", "moe_combine", "gdn_conv", "gdn_core")

_installed: dict[str, str] = {}
_wrapped: dict[tuple[type, str], Callable[..., Any]] = {}


def _replacements() -> dict[str, type]:
    """vLLM class name -> IsoExec's out-of-tree replacement (pluggable layers)."""
    return {**moe.REPLACEMENTS, **gdn.REPLACEMENTS}


def _register_custom_ops(strict: bool) -> dict[str, str]:
    from vllm.model_executor.custom_op import CustomOp, op_registry_oot

    done = {}
    for name, cls in _replacements().items():
        current = op_registry_oot.get(name)
        if current is None:
            stock_name = getattr(cls, "name", name)  # inherited from the vLLM class it replaces
            CustomOp.register_oot(cls, name=name)
            cls.name = stock_name  # keep vLLM's custom-op name, so enabling/dispatch is unchanged when off
        elif current is not cls:
            if strict:
                raise RuntimeError(
                    f"IsoExec cannot install its {name} into vLLM: another plugin already replaced it with "
                    f"{current.__module__}.{current.__qualname__}"
                )
            continue  # IsoExec is off here; a model built with it on would be refused at load
        done[f"CustomOp {name}"] = f"{cls.__module__}.{cls.__qualname__}"
    return done


def _refuse_config(vllm_config: Any) -> None:
    problems = checks.config_problems(vllm_config)
    allowlist = checks.allowlist_problem()
    if allowlist is not None:
        problems.append(allowlist)
    if problems:
        raise checks.IsoExecRefusal(problems)


def _wrap_create_engine_config(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def create_engine_config(self, *args, **kwargs):
        config = original(self, *args, **kwargs)
        if runtime.active():
            checks.set_canonical_defaults(config)
            _refuse_config(config)
        return config

    return create_engine_config


def model_loading(vllm_config: Any) -> None:
    """A vLLM process is about to build a model (``skyrl_engine_model_loading``): with IsoExec on,
    refuse a configuration the canonical ops cannot run under."""
    if runtime.active():
        _refuse_config(vllm_config)


def model_loaded(model: Any) -> None:
    """A vLLM process built ``model`` and skyrl-vllm's op sites routed it
    (``skyrl_engine_model_loaded``, before the KV cache and attention backends are set up): with
    IsoExec on, inspect it and adopt its ledger. IsoExec's state cannot change between the two
    moments of one load, so the model's modules were built under the state read here."""
    if runtime.active():
        _inspect(model)


def _inspect(model: Any) -> None:
    """Refuse ``model`` if a module computes without a canonical op; else complete its ledger."""
    ledger = checks.routed_ledger(model)
    op_modules, patched, unpatched = checks.inspect_model(model, ledger.meta)
    if unpatched:
        raise checks.IsoExecRefusal(
            [f"these modules of {type(model).__name__} have no canonical op inside vLLM: {', '.join(unpatched)}"]
        )
    ledger.meta.update(
        op_modules=op_modules,
        patched_modules=patched,
        unpatched=[],
        installed=dict(_installed),
        fused_linear=checks.fused_linears(model),
        prepacked_linear=checks.prepacked_linears(model),
    )
    runtime.adopt_ledger(ledger)  # the attention backends built next record this model's steps there


def _wrap(cls: type, name: str, wrapper: Callable[[Callable[..., Any]], Callable[..., Any]]) -> None:
    if (cls, name) not in _wrapped:
        original = cls.__dict__[name]
        _wrapped[(cls, name)] = original
        setattr(cls, name, wrapper(original))


def install(strict: bool = True) -> dict[str, str]:
    """Install everything (once per process); return ``{what vLLM had: what replaces it}``.

    ``strict`` (IsoExec on now) makes a rival plugin's replacement of one of our ops an error;
    otherwise that op is left to the rival, and a model built later with IsoExec on is refused.
    """
    if _installed:
        return dict(_installed)
    from vllm.engine.arg_utils import EngineArgs

    # Attention, MoE and GatedDeltaNet compute over vLLM's own state with IsoExec's own layers
    # (below); skyrl-vllm's op sites call the other canonical ops in vLLM's layers.
    engine_forms.declare_own_layers("vllm", [CANONICAL[op].name for op in OWN_LAYER_OPS], "skyrl-isoexec")
    installed = _register_custom_ops(strict)
    installed.update(attention.install())
    _wrap(EngineArgs, "create_engine_config", _wrap_create_engine_config)
    _installed.update(installed)
    return dict(_installed)


def installed() -> dict[str, str]:
    """What ``install`` put in place in this process (empty before)."""
    return dict(_installed)


def uninstall() -> None:
    """Restore vLLM's own classes in this process (tests)."""
    from vllm.model_executor.custom_op import op_registry_oot

    for name, cls in _replacements().items():
        if op_registry_oot.get(name) is cls:
            del op_registry_oot[name]
    engine_forms.forget_own_layers("vllm", "skyrl-isoexec")
    attention.uninstall()
    for (cls, name), original in list(_wrapped.items()):
        setattr(cls, name, original)
        del _wrapped[(cls, name)]
    _installed.clear()
