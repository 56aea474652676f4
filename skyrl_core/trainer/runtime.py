"""Building the run's engine and backend from config, and the execution-contract handshake."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

import attrs

from skyrl_core.config.schema import Config, ModelConfig
from skyrl_core.model_sources import make_if_missing
from skyrl_core.plugins.building import build_selected
from skyrl_core.types import HandshakeVerdict

if TYPE_CHECKING:
    from skyrl_core.interfaces import InferenceEngine, TrainingBackend
    from skyrl_core.plugins.manager import SkyrlPluginManager
    from skyrl_core.ray_placement import RayPlacement


class HandshakeError(RuntimeError):
    """Trainer and engine declared different execution contracts; weights must not be synced."""


def resolve_model(model: ModelConfig, plugin_manager: SkyrlPluginManager | None = None) -> ModelConfig:
    """``model`` with ``~`` expanded in its paths; a missing directory that a registered model source
    makes (e.g. the demo model) is made first."""
    if model.path is None:
        return model
    path = os.path.abspath(os.path.expanduser(model.path))
    make_if_missing(path, plugin_manager)
    tokenizer = os.path.expanduser(model.tokenizer) if model.tokenizer else None
    return attrs.evolve(model, path=path, tokenizer=tokenizer)


def build_engine(plugin_manager: SkyrlPluginManager, cfg: Config, model: ModelConfig, *,
                 placement: RayPlacement | None = None, run_dir: str | None = None) -> InferenceEngine:
    """The run's engine: in this process (``engine.placement: colocated``), or ``engine.replicas``
    Ray actor processes behind a router, placed by ``placement`` (``separate``)."""
    if cfg.engine.placement == "separate":
        from skyrl_core.engine_router import start_separate_engines

        return start_separate_engines(cfg, model, placement=placement, run_dir=run_dir)
    return build_selected(plugin_manager, "inference_engine", cfg.engine, model, seed=cfg.trainer.seed)


def check_engine_placement(cfg: Config, plugin_manager: SkyrlPluginManager | None = None) -> None:
    """Refuse, before any work, ``engine`` keys that would not do what they say (docs/config.md).

    ``separate`` needs an engine whose class declares ``supports_separate_process`` (it is built
    inside a Ray actor process and its weights reach it by broadcast or checkpoint)."""
    from skyrl_core.config.errors import ConfigError, ConfigIssue
    from skyrl_core.config.schema import EngineConfig

    ec, defaults = cfg.engine, EngineConfig(name=cfg.engine.name)
    issues = []
    if ec.placement == "colocated":
        for key in ("replicas", "weight_sync", "restart_on_failure", "ray_placement", "trainer_bundle", "engine_bundle"):
            if getattr(ec, key) != getattr(defaults, key):
                issues.append(ConfigIssue(
                    f"engine.{key}", f"{getattr(ec, key)!r} needs engine.placement=separate (the colocated engine "
                    f"runs in the trainer's process: one replica, in-process weights, placed with the trainer)",
                    allowed=(repr(getattr(defaults, key)),)))
    elif not _engine_supports_separate_process(ec.name, plugin_manager):
        issues.append(ConfigIssue(
            "engine.placement", f"'separate' (engines as Ray actor processes) needs an engine that declares "
            f"supports_separate_process (engines 'torch' and 'vllm' do); engine {ec.name!r} runs colocated",
            allowed=("colocated",)))
    elif ec.ray_placement == "disaggregate":
        world_size = getattr(cfg.backend.options, "world_size", 1)
        if world_size < 2:
            issues.append(ConfigIssue(
                "engine.ray_placement", f"'disaggregate' places the trainer's Ray rank actors on their own node; "
                f"backend {cfg.backend.name!r} with world_size={world_size} trains in this process, which Ray does not "
                "place: use backend.options.world_size >= 2, or ray_placement=colocate", allowed=("colocate",)))
    if issues:
        raise ConfigError(issues)


def _engine_supports_separate_process(name: str, plugin_manager: SkyrlPluginManager | None) -> bool:
    if plugin_manager is None:
        from skyrl_core.plugins.manager import get_plugin_manager

        plugin_manager = get_plugin_manager()
    return bool(getattr(plugin_manager.spec("inference_engine", name).load_factory(), "supports_separate_process", False))


def build_backend(plugin_manager: SkyrlPluginManager, cfg: Config, model: ModelConfig) -> TrainingBackend:
    return build_selected(plugin_manager, "training_backend", cfg.backend, model, seed=cfg.trainer.seed, trainer=cfg.trainer)


def _contract(plugin_manager: SkyrlPluginManager, role: str,
              runtime: TrainingBackend | InferenceEngine) -> dict[str, Any]:
    """The runtime's own contract plus each plugin's contribution under the plugin's name."""
    own = runtime.execution_contract()
    contract: dict[str, Any] = {"runtime": own}
    for impl in plugin_manager.hook.skyrl_execution_contract.get_hookimpls():
        contribution = impl.function(role=role, ledger=own.get("ledger"))
        if contribution is not None:
            contract[impl.plugin_name] = contribution
    return contract


def handshake(plugin_manager: SkyrlPluginManager, backend: TrainingBackend,
              engine: InferenceEngine) -> HandshakeVerdict:
    """Exchange contracts before a weight sync; raise ``HandshakeError`` listing every mismatch any
    plugin reports. Returns the plugins' combined verdict (whether the engine's logprobs are the
    trainer's, bit for bit)."""
    trainer_contract = _contract(plugin_manager, "trainer", backend)
    verdicts = []
    # separate engines (a router): every replica's process is checked against the trainer
    for each in getattr(engine, "replicas", None) or [engine]:
        engine_contract = _contract(plugin_manager, "engine", each)
        for impl in plugin_manager.hook.skyrl_verify_handshake.get_hookimpls():
            answer = impl.function(trainer_contract=trainer_contract, engine_contract=engine_contract)
            if answer is None:
                continue
            if not isinstance(answer, HandshakeVerdict):
                raise TypeError(f"plugin {impl.plugin_name!r}: skyrl_verify_handshake returned a "
                                f"{type(answer).__name__}, not a skyrl_core.types.HandshakeVerdict (or None)")
            verdicts.append(answer)
    verdict = HandshakeVerdict.combine(verdicts)
    if verdict.mismatches:
        lines = "\n  ".join(verdict.mismatches)
        raise HandshakeError(f"trainer and engine execution contracts differ; refusing to sync weights:\n  {lines}")
    return verdict
