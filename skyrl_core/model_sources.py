"""Models that plugins make on first use (``ModelSourceSpec``): finding the source of a missing
``model.path``, checking what it needs before a run, and making it when the run starts."""

from __future__ import annotations

import os
from importlib import metadata
from typing import TYPE_CHECKING

from skyrl_core.plugins.records import ModelSourceSpec

if TYPE_CHECKING:
    from skyrl_core.plugins.manager import SkyrlPluginManager


def source_for(path: str, plugin_manager: SkyrlPluginManager | None = None) -> ModelSourceSpec | None:
    """The registered model source whose directory is ``path``, if any."""
    if plugin_manager is None:
        from skyrl_core.plugins.manager import get_plugin_manager

        plugin_manager = get_plugin_manager()
    for name in plugin_manager.registry.names("model_source"):
        spec = plugin_manager.spec("model_source", name)
        if spec.matches(path):
            return spec
    return None


def missing_distributions(spec: ModelSourceSpec) -> list[str]:
    """The distributions ``spec`` requires that are not installed (from metadata: nothing imported)."""
    missing = []
    for dist in spec.requires:
        try:
            metadata.version(dist)
        except metadata.PackageNotFoundError:
            missing.append(dist)
    return missing


def make_if_missing(path: str, plugin_manager: SkyrlPluginManager | None = None) -> None:
    """Create ``path`` with its model source when it does not exist yet (no-op otherwise)."""
    full = os.path.abspath(os.path.expanduser(path))
    if os.path.isdir(full):
        return
    spec = source_for(full, plugin_manager)
    if spec is None:
        return
    print(f"preparing {spec.name} in {full} (once) ...", flush=True)
    spec.load_factory()(full)
