"""Installing IsoExec's canonical ops into vLLM in the current process (idempotent).

Runs from ``skyrl_worker_init(role="engine")``, which skyrl's vLLM bootstrap calls in every vLLM
process it starts (front-end, engine core, each worker) before any model is built:

1. ``register_oot`` for ``RMSNorm``, ``SiluAndMul`` and ``RotaryEmbedding`` (``layers.REPLACEMENTS``),
   and for the MoE block's ``MoERunner`` and ``UnquantizedFusedMoEMethod`` (``moe.REPLACEMENTS``);
2. the unquantized linear / lm_head / embedding methods (``linear.install``);
3. the ``CPU_ATTN`` attention backend (``attention.install``);
4. ``Sampler.compute_logprobs`` (``sampler.install``);
5. two checkpoints: vLLM's config is checked in the front-end (``EngineArgs.create_engine_config``)
   and in the worker, and the model a worker built is inspected (``load_model``): anything IsoExec
   cannot make identical is refused with one sentence, and the worker's op ledger (declared
   implementations, calls per site, what is installed) is attached to the model as
   ``_skyrl_op_ledger``, where skyrl's worker attestation RPC reads it.

Everything installed is inert for modules built while IsoExec is off: each replacement decides
when its module is built (or its weights processed) and otherwise runs vLLM's own code. So skyrl
installs it in every vLLM process it starts, on or off: an in-process engine (one Python process
for trainer and vLLM, whose plugins vLLM loads only once) can then be built with IsoExec on after
one built with it off, and the reverse.
"""

from __future__ import annotations

import functools
from typing import Any, Callable

from skyrl_core.ops import engine_forms

from skyrl_isoexec.specs import CANONICAL
from skyrl_isoexec.vllm import attention, checks, gdn, layers, linear, moe, runtime, sampler

_installed: dict[str, str] = {}
_wrapped: dict[tuple[type, str], Callable[..., Any]] = {}


def _replacements() -> dict[str, type]:
    """vLLM class name -> IsoExec's out-of-tree replacement (ops and pluggable layers)."""
    return {**layers.REPLACEMENTS, **moe.REPLACEMENTS, **gdn.REPLACEMENTS}


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


def _forget_cached_rotary_embeddings(active: bool) -> None:
    """vLLM shares rotary modules between models built in one process (``get_rope``'s cache); one
    built with IsoExec in the other state must not be reused by this model."""
    from vllm.model_executor.layers.rotary_embedding import _ROPE_DICT

    for key, module in list(_ROPE_DICT.items()):
        if getattr(module, "_isoexec", False) != active:
            del _ROPE_DICT[key]


def _wrap_load_model(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def load_model(self, *args, **kwargs):
        active = runtime.active()
        _forget_cached_rotary_embeddings(active)
        if active:
            _refuse_config(self.vllm_config)
            runtime.new_ledger()
        result = original(self, *args, **kwargs)
        sampler.mark(self.sampler, active)
        if active:
            op_modules, patched, unpatched = checks.inspect_model(self.model)
            if unpatched:
                raise checks.IsoExecRefusal(
                    [f"these modules of {type(self.model).__name__} have no canonical op inside vLLM: {', '.join(unpatched)}"]
                )
            ledger = runtime.ledger()
            ledger.meta.update(
                architecture=type(self.model).__name__,
                dtype=str(self.vllm_config.model_config.dtype).removeprefix("torch."),
                op_modules=op_modules,
                patched_modules=patched,
                unpatched=[],
                installed=dict(_installed),
                fused_linear=linear.fused_layers(self.model),
                prepacked_linear=linear.prepacked_layers(self.model),
            )
            self.model._skyrl_op_ledger = ledger
        return result

    return load_model


def _wrap(cls: type, name: str, wrapper: Callable[[Callable[..., Any]], Callable[..., Any]]) -> None:
    if (cls, name) not in _wrapped:
        original = cls.__dict__[name]
        _wrapped[(cls, name)] = original
        setattr(cls, name, wrapper(original))


def _runner_classes() -> list[type]:
    """vLLM's model runners here: the CPU one on CPU, the GPU one otherwise."""
    from vllm.platforms import current_platform

    if current_platform.is_cpu():
        from vllm.v1.worker.cpu_model_runner import CPUModelRunner

        return [CPUModelRunner]
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    return [GPUModelRunner]


def install(strict: bool = True) -> dict[str, str]:
    """Install everything (once per process); return ``{what vLLM had: what replaces it}``.

    ``strict`` (IsoExec on now) makes a rival plugin's replacement of one of our ops an error;
    otherwise that op is left to the rival, and a model built later with IsoExec on is refused.
    """
    if _installed:
        return dict(_installed)
    from vllm.engine.arg_utils import EngineArgs

    # IsoExec computes every canonical op inside vLLM with its own layers (below): skyrl-vllm's op
    # sites leave those layers to it.
    engine_forms.declare_own_layers("vllm", [spec.name for spec in CANONICAL.values()], "skyrl-isoexec")
    installed = _register_custom_ops(strict)
    installed.update(linear.install())
    installed.update(attention.install())
    installed.update(sampler.install())
    _wrap(EngineArgs, "create_engine_config", _wrap_create_engine_config)
    for runner in _runner_classes():
        _wrap(runner, "load_model", _wrap_load_model)
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
    linear.uninstall()
    attention.uninstall()
    sampler.uninstall()
    for (cls, name), original in list(_wrapped.items()):
        setattr(cls, name, original)
        del _wrapped[(cls, name)]
    _installed.clear()
