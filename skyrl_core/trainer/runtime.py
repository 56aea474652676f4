"""Building the run's engine and backend from config, and the execution-contract handshake."""

from __future__ import annotations

import os
from typing import Any

import attrs

from skyrl_core.config.schema import Config, ModelConfig, Selection
from skyrl_core.model_sources import make_if_missing
from skyrl_core.types import HandshakeVerdict


class HandshakeError(RuntimeError):
    """Trainer and engine declared different execution contracts; weights must not be synced."""


def resolve_model(model: ModelConfig, plugin_manager: Any = None) -> ModelConfig:
    """``model`` with ``~`` expanded in its paths; a missing directory that a registered model source
    makes (e.g. the demo model) is made first."""
    if model.path is None:
        return model
    path = os.path.abspath(os.path.expanduser(model.path))
    make_if_missing(path, plugin_manager)
    tokenizer = os.path.expanduser(model.tokenizer) if model.tokenizer else None
    return attrs.evolve(model, path=path, tokenizer=tokenizer)


def build_selected(plugin_manager: Any, kind: str, selection: Selection, *args: Any, **kwargs: Any) -> Any:
    """Build the component ``selection`` names, passing its already structured options object:
    ``factory(*args, options, **kwargs)`` (engines and backends take ``(model, options, ...)``)."""
    spec = plugin_manager.spec(kind, selection.name)
    options = selection.options
    if isinstance(options, dict):  # a Selection made in Python rather than by the config loader
        from skyrl_core.config.loader import structure_options

        options = structure_options(spec, options, path=f"{kind}:{selection.name}")
    return spec.load_factory()(*args, options, **kwargs)


def build_engine(plugin_manager: Any, cfg: Config, model: ModelConfig) -> Any:
    return build_selected(plugin_manager, "inference_engine", cfg.engine, model, seed=cfg.trainer.seed)


def build_backend(plugin_manager: Any, cfg: Config, model: ModelConfig) -> Any:
    return build_selected(plugin_manager, "training_backend", cfg.backend, model, seed=cfg.trainer.seed, trainer=cfg.trainer)


def _contract(plugin_manager: Any, role: str, runtime: Any) -> dict[str, Any]:
    """The runtime's own contract plus each plugin's contribution under the plugin's name."""
    own = runtime.execution_contract()
    contract: dict[str, Any] = {"runtime": own}
    for impl in plugin_manager.hook.skyrl_execution_contract.get_hookimpls():
        contribution = impl.function(role=role, ledger=own.get("ledger"))
        if contribution is not None:
            contract[impl.plugin_name] = contribution
    return contract


def handshake(plugin_manager: Any, backend: Any, engine: Any) -> HandshakeVerdict:
    """Exchange contracts before a weight sync; raise ``HandshakeError`` listing every mismatch any
    plugin reports. Returns the plugins' combined verdict (whether the engine's logprobs are the
    trainer's, bit for bit)."""
    trainer_contract = _contract(plugin_manager, "trainer", backend)
    engine_contract = _contract(plugin_manager, "engine", engine)
    verdicts = []
    for impl in plugin_manager.hook.skyrl_verify_handshake.get_hookimpls():
        answer = impl.function(trainer_contract=trainer_contract, engine_contract=engine_contract)
        if answer is None:
            continue
        if not isinstance(answer, HandshakeVerdict):
            raise TypeError(f"plugin {impl.plugin_name!r}: skyrl_verify_handshake returned a {type(answer).__name__}, "
                            "not a skyrl_core.types.HandshakeVerdict (or None)")
        verdicts.append(answer)
    verdict = HandshakeVerdict.combine(verdicts)
    if verdict.mismatches:
        lines = "\n  ".join(verdict.mismatches)
        raise HandshakeError(f"trainer and engine execution contracts differ; refusing to sync weights:\n  {lines}")
    return verdict
