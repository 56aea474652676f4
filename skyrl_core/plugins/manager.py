"""The plugin manager: loads built-ins and installed plugins, collects what they register.

Loading order: the core's built-in plugins, then every entry point of the group ``skyrl`` (each one
loaded in isolation: a plugin that fails to import or to register is recorded with its error and
the others go on), then environments from the entry-point group ``skyrl.environments`` (each loaded in isolation too;
whatever a plugin raises, ``SystemExit`` and ``KeyboardInterrupt`` included, is recorded).

Environment variables:
- ``SKYRL_DISABLE_PLUGIN_AUTOLOAD=1``: load only the built-ins (and plugins registered by hand).
- ``SKYRL_PLUGINS=a,b``: an allowlist of entry-point names to load (built-ins always load); a name
  that is not installed is warned about (``SkyrlPluginWarning``) and listed as "not installed".
"""

from __future__ import annotations

import difflib
import importlib
import os
import sys
import traceback
import warnings
from importlib import metadata
from typing import Any, Callable, Iterable

import attrs
import pluggy

from skyrl_core.plugins import PROJECT_NAME, hookspecs
from skyrl_core.plugins.installation import missing_requirements
from skyrl_core.plugins.records import RECORD_BY_KIND, ComponentSpec, EnvironmentSpec

ENTRY_POINT_GROUP = "skyrl"
ENVIRONMENT_GROUP = "skyrl.environments"

# The core's own implementations, registered first through the same hooks third parties use.
BUILTIN_PLUGINS: tuple[tuple[str, str], ...] = (
    ("core", "skyrl_core.plugins.builtin"),
    ("core.algorithms", "skyrl_core.algorithms.plugin"),
)

REGISTRATION_HOOKS: dict[str, str] = {
    "skyrl_register_training_backends": "training_backend",
    "skyrl_register_inference_engines": "inference_engine",
    "skyrl_register_algorithms": "policy_loss",  # also advantage estimators: the record says which
    "skyrl_register_environments": "environment",
    "skyrl_register_ops": "op_impl",
    "skyrl_register_config_sections": "config_section",
    "skyrl_register_loggers": "logger",
    "skyrl_register_model_sources": "model_source",
}


class SkyrlPluginWarning(UserWarning):
    """Something about the installed plugins the user should know (e.g. an unknown SKYRL_PLUGINS name)."""


class PluginError(Exception):
    """A plugin problem the user must fix (duplicate names, unknown components)."""


class UnknownComponentError(PluginError):
    def __init__(self, kind: str, name: str, allowed: list[str]) -> None:
        self.kind, self.name, self.allowed = kind, name, allowed
        title = RECORD_BY_KIND[kind].kind_title
        msg = f"{name!r} is not a registered {title}; registered: {', '.join(allowed) or '(none)'}"
        close = difflib.get_close_matches(name, allowed, n=1)
        if close:
            msg += f". Did you mean {close[0]!r}?"
        super().__init__(msg)


@attrs.define
class PluginInfo:
    """One row of ``skyrl plugins list``: a built-in, an installed plugin, or an environment entry point."""

    name: str
    distribution: str
    version: str
    kind: str  # "builtin" | "plugin" | "environments"
    status: str = "ok"  # "ok" | "failed" | "disabled" | "not installed"
    error: str | None = None
    provides: list[str] = attrs.field(factory=list)
    # Runtime requirements of its distribution that are not installed (from package metadata): the
    # plugin registers, but its components cannot run until they are.
    missing_requirements: list[str] = attrs.field(factory=list)

    def as_dict(self) -> dict[str, Any]:
        return attrs.asdict(self)


@attrs.define
class Registry:
    """Registered records by kind and name, each remembered with the plugin that registered it."""

    entries: dict[str, dict[str, tuple[ComponentSpec, PluginInfo]]] = attrs.field(
        factory=lambda: {kind: {} for kind in RECORD_BY_KIND}
    )

    def add(self, spec: ComponentSpec, owner: PluginInfo) -> None:
        table = self.entries[spec.kind]
        if spec.name in table:
            _, first = table[spec.name]
            raise PluginError(
                f"{spec.kind_title} {spec.name!r} is registered twice: by {first.distribution} "
                f"(plugin {first.name!r}) and by {owner.distribution} (plugin {owner.name!r})"
            )
        table[spec.name] = (spec, owner)
        owner.provides.append(f"{spec.kind}:{spec.name}")

    def add_all(self, specs: list[ComponentSpec], owner: PluginInfo) -> None:
        """Add every one of ``specs`` or, on the first clash, none."""
        seen: set[tuple[str, str]] = set()
        for spec in specs:
            if (spec.kind, spec.name) in seen:
                raise PluginError(f"{spec.kind_title} {spec.name!r} is registered twice by {owner.distribution} "
                                  f"(plugin {owner.name!r})")
            seen.add((spec.kind, spec.name))
            if spec.name in self.entries[spec.kind]:
                self.add(spec, owner)  # raises, naming both plugins
        for spec in specs:
            self.add(spec, owner)

    def names(self, kind: str) -> list[str]:
        return sorted(self.entries[kind])

    def get(self, kind: str, name: str) -> ComponentSpec:
        try:
            return self.entries[kind][name][0]
        except KeyError:
            raise UnknownComponentError(kind, name, self.names(kind)) from None

    def owner(self, kind: str, name: str) -> PluginInfo:
        return self.entries[kind][name][1]


class SkyrlPluginManager(pluggy.PluginManager):
    """``pluggy.PluginManager("skyrl")`` plus skyrl's loading policy and registry."""

    def __init__(self) -> None:
        super().__init__(PROJECT_NAME)
        self.add_hookspecs(hookspecs)
        self.infos: dict[str, PluginInfo] = {}
        self._registry: Registry | None = None

    # -- loading ---------------------------------------------------------------------------------

    def load_builtins(self) -> None:
        from skyrl_core import __version__

        for name, module_path in BUILTIN_PLUGINS:
            self._load_one(name, "skyrl-core", __version__, "builtin", lambda m=module_path: importlib.import_module(m))

    def load_entrypoints(self) -> None:
        """Load every ``skyrl`` entry point, honouring the autoload switch and the allowlist."""
        if _truthy(os.environ.get("SKYRL_DISABLE_PLUGIN_AUTOLOAD")):
            return
        allow = _allowlist()
        installed = _entry_points(ENTRY_POINT_GROUP)
        for unknown in sorted((allow or set()) - {ep.name for ep in installed}):
            message = (f"SKYRL_PLUGINS names {unknown!r}, which is not an installed plugin; installed: "
                       f"{', '.join(ep.name for ep in installed) or '(none)'}")
            self.infos[unknown] = PluginInfo(unknown, "-", "-", "plugin", status="not installed", error=message)
            warnings.warn(message, SkyrlPluginWarning, stacklevel=2)
        for ep in installed:
            dist = ep.dist.name if ep.dist else "?"
            version = ep.dist.version if ep.dist else "?"
            if allow is not None and ep.name not in allow:
                self.infos[ep.name] = PluginInfo(ep.name, dist, version, "plugin", status="disabled",
                                                 error="not in SKYRL_PLUGINS")
                continue
            self._load_one(ep.name, dist, version, "plugin", ep.load)

    def _load_one(self, name: str, dist: str, version: str, kind: str, load: Callable[[], Any]) -> None:
        info = PluginInfo(name, dist, version, kind)
        self.infos[name] = info
        if kind == "plugin":
            info.missing_requirements = missing_requirements(dist)
        try:
            plugin = load()
            self.register(plugin, name=name)
            self.check_pending()
        # A broken plugin must never break the others, whatever it raises: sys.exit() and
        # KeyboardInterrupt at import are BaseExceptions, and would otherwise end every command.
        except BaseException as exc:  # noqa: BLE001
            if self.has_plugin(name):
                self.unregister(name=name)
            info.status, info.error = "failed", _describe(exc)
        self._registry = None

    def register_plugin(self, plugin: Any, name: str, distribution: str = "(local)", version: str = "0") -> None:
        """Register an in-process plugin object (tests, notebooks) as if it were installed."""
        self._load_one(name, distribution, version, "plugin", lambda: plugin)

    # -- registry ---------------------------------------------------------------------------------

    @property
    def registry(self) -> Registry:
        if self._registry is None:
            self._registry = self._collect()
        return self._registry

    def _collect(self) -> Registry:
        """Every plugin's records, all or nothing per plugin: one that fails in any registration
        hook, or registers a name twice or a name another plugin registered first, is marked
        failed and contributes nothing (the others, and every command, go on)."""
        registry = Registry()
        for info in self.infos.values():
            info.provides.clear()
        by_owner: dict[str, list[ComponentSpec]] = {}
        owners: dict[str, PluginInfo] = {}
        for hook_name, default_kind in REGISTRATION_HOOKS.items():
            for impl in getattr(self.hook, hook_name).get_hookimpls():
                owner = self.infos.get(impl.plugin_name) or PluginInfo(impl.plugin_name, "?", "?", "plugin")
                if owner.status != "ok":
                    continue
                owners[impl.plugin_name] = owner
                allowed_kinds = {"policy_loss", "advantage_estimator"} if default_kind == "policy_loss" else {default_kind}
                collected = by_owner.setdefault(impl.plugin_name, [])

                def register(spec: ComponentSpec, _kinds=allowed_kinds, _hook=hook_name, _out=collected) -> None:
                    if not isinstance(spec, ComponentSpec) or spec.kind not in _kinds:
                        raise TypeError(f"{_hook} received {spec!r}; expected a record of kind {sorted(_kinds)}")
                    _out.append(spec)

                try:
                    impl.function(register=register)
                except BaseException as exc:  # noqa: BLE001 - see _load_one
                    owner.status, owner.error = "failed", _describe(exc)
        for plugin_name, specs in by_owner.items():
            owner = owners[plugin_name]
            if owner.status != "ok":
                continue
            try:
                registry.add_all(specs, owner)
            except PluginError as exc:
                owner.status, owner.error = "failed", str(exc)
        self._load_environment_entrypoints(registry)
        return registry

    def _load_environment_entrypoints(self, registry: Registry) -> None:
        """Environments mapped by one line in a package's pyproject (group ``skyrl.environments``)."""
        if _truthy(os.environ.get("SKYRL_DISABLE_PLUGIN_AUTOLOAD")):
            return
        by_name = {ep.name: ep for ep in _entry_points(ENVIRONMENT_GROUP)}
        for ep_name, ep in sorted(by_name.items()):
            dist = ep.dist.name if ep.dist else "?"
            version = ep.dist.version if ep.dist else "?"
            info = self.infos.setdefault(f"env:{ep_name}", PluginInfo(ep_name, dist, version, "environments"))
            info.provides.clear()
            try:
                ep.load()  # for validation; the factory is imported again lazily on use
            except BaseException as exc:  # noqa: BLE001 - see _load_one
                info.status, info.error = "failed", _describe(exc)
                continue
            spec = EnvironmentSpec(name=ep_name, factory=ep.value, description=f"entry point of {dist}")
            try:
                registry.add(spec, info)
            except PluginError as exc:
                info.status, info.error = "failed", str(exc)

    # -- building components ---------------------------------------------------------------------

    def spec(self, kind: str, name: str) -> ComponentSpec:
        return self.registry.get(kind, name)

    def listing(self) -> list[PluginInfo]:
        """Every plugin with what it provides (forces registration)."""
        try:
            self.registry
        except PluginError as exc:
            return [*self.infos.values(), PluginInfo("(registry)", "-", "-", "error", "failed", str(exc))]
        return list(self.infos.values())


def _entry_points(group: str) -> list[metadata.EntryPoint]:
    seen: dict[tuple[str, str], metadata.EntryPoint] = {}
    for ep in metadata.entry_points(group=group):
        seen.setdefault((ep.name, ep.value), ep)  # editable installs can list one twice
    return sorted(seen.values(), key=lambda ep: ep.name)


def _allowlist() -> set[str] | None:
    raw = os.environ.get("SKYRL_PLUGINS")
    if raw is None or not raw.strip():
        return None
    return {part.strip() for part in raw.split(",") if part.strip()}


def _truthy(value: str | None) -> bool:
    return (value or "").strip().lower() in {"1", "true", "yes", "on"}


def _describe(exc: BaseException) -> str:
    frames = traceback.extract_tb(exc.__traceback__)
    where = f" ({frames[-1].filename}:{frames[-1].lineno})" if frames else ""
    return f"{type(exc).__name__}: {exc}{where}"


_manager: SkyrlPluginManager | None = None


def new_plugin_manager(*, autoload: bool = True, extra_plugins: Iterable[tuple[str, Any]] = ()) -> SkyrlPluginManager:
    """A fresh manager: built-ins, then (if ``autoload``) installed plugins, then ``extra_plugins``."""
    pm = SkyrlPluginManager()
    pm.load_builtins()
    if autoload:
        pm.load_entrypoints()
    for name, plugin in extra_plugins:
        pm.register_plugin(plugin, name)
    return pm


def get_plugin_manager() -> SkyrlPluginManager:
    """The process-wide manager, created on first use."""
    global _manager
    if _manager is None:
        _manager = new_plugin_manager()
    return _manager


def set_plugin_manager(pm: SkyrlPluginManager | None) -> SkyrlPluginManager | None:
    """Replace the process-wide manager (tests); returns the previous one."""
    global _manager
    previous, _manager = _manager, pm
    return previous


def heavy_modules_loaded() -> list[str]:
    """Which of the heavy engine modules are imported in this process (for tests and debugging)."""
    heavy = ("vllm", "sglang", "megatron", "torch.distributed")
    return sorted(m for m in heavy if m in sys.modules)
