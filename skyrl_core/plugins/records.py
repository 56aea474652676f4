"""Frozen records that plugins register through the registration hooks.

A record names a component and says how to build it *lazily*: ``factory`` and ``options`` are
``"module:attr"`` strings that are imported only when the component is selected, so registering
never imports torch, vllm, sglang or megatron.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any, ClassVar

import attrs

if TYPE_CHECKING:
    from skyrl_core.config.schema import Config


def _check_import_path(instance: Any, attribute: attrs.Attribute, value: str | None) -> None:
    if value is None and attribute.name != "factory":
        return
    if not isinstance(value, str) or value.count(":") != 1 or not all(value.split(":")):
        raise ValueError(
            f"{type(instance).__name__}.{attribute.name} must be a 'module:attr' string, got {value!r}"
        )


def _check_name(instance: Any, attribute: attrs.Attribute, value: str) -> None:
    if not isinstance(value, str) or not value or value != value.strip() or " " in value:
        raise ValueError(f"{type(instance).__name__}.name must be a non-empty word, got {value!r}")


def import_object(path: str) -> Any:
    """Import ``"package.module:attr.sub"`` and return the attribute."""
    module_name, _, attr_path = path.partition(":")
    obj: Any = importlib.import_module(module_name)
    for part in attr_path.split("."):
        obj = getattr(obj, part)
    return obj


@attrs.frozen(kw_only=True)
class ComponentSpec:
    """What every registration record has: a name, a lazy factory, an options class, a description."""

    kind: ClassVar[str] = "component"
    kind_title: ClassVar[str] = "component"

    name: str = attrs.field(validator=_check_name)
    factory: str = attrs.field(validator=_check_import_path)
    options: str | None = attrs.field(default=None, validator=_check_import_path)
    description: str = ""
    # ``"module:function"``, called before a run as ``function(config, options)`` with the whole
    # ``Config`` and this component's structured options; returns the problems (one sentence each,
    # e.g. "needs a CUDA GPU") that would stop the component here. Must import nothing heavy.
    preflight: str | None = attrs.field(default=None, validator=_check_import_path)

    def load_factory(self) -> Any:
        return import_object(self.factory)

    def preflight_problems(self, config: Config, options: Any) -> list[str]:
        if self.preflight is None:
            return []
        return [str(p) for p in import_object(self.preflight)(config, options) or ()]

    def load_options_class(self) -> type | None:
        return import_object(self.options) if self.options else None


@attrs.frozen(kw_only=True)
class TrainingBackendSpec(ComponentSpec):
    """A training backend. ``factory(model: ModelConfig, options, *, seed: int) -> TrainingBackend``."""

    kind: ClassVar[str] = "training_backend"
    kind_title: ClassVar[str] = "training backend"


@attrs.frozen(kw_only=True)
class InferenceEngineSpec(ComponentSpec):
    """An inference engine. ``factory(model: ModelConfig, options, *, seed: int) -> InferenceEngine``."""

    kind: ClassVar[str] = "inference_engine"
    kind_title: ClassVar[str] = "inference engine"


@attrs.frozen(kw_only=True)
class PolicyLossSpec(ComponentSpec):
    """A policy loss. ``factory(options) -> PolicyLoss`` (see ``skyrl_core.interfaces.PolicyLoss``)."""

    kind: ClassVar[str] = "policy_loss"
    kind_title: ClassVar[str] = "policy loss"


@attrs.frozen(kw_only=True)
class AdvantageEstimatorSpec(ComponentSpec):
    """An advantage estimator. ``factory(options) -> AdvantageEstimator``."""

    kind: ClassVar[str] = "advantage_estimator"
    kind_title: ClassVar[str] = "advantage estimator"


@attrs.frozen(kw_only=True)
class EnvironmentSpec(ComponentSpec):
    """An environment. ``factory(**options) -> Environment`` (a class or a function).

    Without an ``options`` class, its options are the factory's typed keyword parameters (see
    ``skyrl_core.plugins.signature_options``)."""

    kind: ClassVar[str] = "environment"
    kind_title: ClassVar[str] = "environment"

    def load_options_class(self) -> type | None:
        if self.options:
            return import_object(self.options)
        from skyrl_core.plugins.signature_options import options_class_from_signature

        return options_class_from_signature(self.load_factory(), self.name)


@attrs.frozen(kw_only=True)
class OpImplSpec(ComponentSpec):
    """One implementation of one op (see ``skyrl_core.ops``).

    ``impl_id`` and ``version`` identify the mathematics; ``constants`` are the pinned values that
    change its result (block sizes, accumulation dtype, ...). ``factory`` resolves to the callable.
    """

    kind: ClassVar[str] = "op_impl"
    kind_title: ClassVar[str] = "op implementation"

    op: str
    version: str = "1"
    constants: tuple[tuple[str, Any], ...] = attrs.field(default=(), converter=lambda c: tuple(sorted(dict(c).items())))


@attrs.frozen(kw_only=True)
class ConfigSectionSpec(ComponentSpec):
    """A top-level config section a plugin adds (e.g. ``isoexec:``). ``options`` is its attrs class."""

    kind: ClassVar[str] = "config_section"
    kind_title: ClassVar[str] = "config section"


@attrs.frozen(kw_only=True)
class LoggerSpec(ComponentSpec):
    """A metrics logger chosen by ``trainer.loggers``. ``factory(run_dir: str, config) -> MetricsSink``
    (see ``skyrl_core.trainer.loggers``)."""

    kind: ClassVar[str] = "logger"
    kind_title: ClassVar[str] = "logger"


@attrs.frozen(kw_only=True)
class ModelSourceSpec(ComponentSpec):
    """A model a plugin can make on first use: when ``model.path`` names ``directory`` and it does not
    exist yet, ``factory(directory) -> str`` creates it there (a converted or shipped model).
    ``requires`` are the distributions the factory needs (checked before a run, from metadata)."""

    kind: ClassVar[str] = "model_source"
    kind_title: ClassVar[str] = "model source"

    directory: str
    requires: tuple[str, ...] = attrs.field(default=(), converter=tuple)

    def matches(self, path: str) -> bool:
        return _full_path(path) == _full_path(self.directory)


def _full_path(path: str) -> str:
    import os

    return os.path.abspath(os.path.expanduser(path))


RECORD_TYPES: tuple[type[ComponentSpec], ...] = (
    TrainingBackendSpec,
    InferenceEngineSpec,
    PolicyLossSpec,
    AdvantageEstimatorSpec,
    EnvironmentSpec,
    OpImplSpec,
    ConfigSectionSpec,
    LoggerSpec,
    ModelSourceSpec,
)
RECORD_BY_KIND: dict[str, type[ComponentSpec]] = {cls.kind: cls for cls in RECORD_TYPES}
