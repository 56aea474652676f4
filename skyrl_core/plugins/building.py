"""Building a registered component from its name and options.

The options are structured and validated like the config's (``skyrl_core.config.loader``), then the
record's factory is called. This lives beside the plugin manager rather than in it: the config
loader asks the manager what is registered, so the manager must not import the loader.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import attrs

from skyrl_core.config.loader import structure_options

if TYPE_CHECKING:
    from skyrl_core.config.schema import Selection
    from skyrl_core.plugins.manager import SkyrlPluginManager


def build_component(plugin_manager: SkyrlPluginManager, kind: str, name: str,
                    options: dict[str, Any] | None = None, **kwargs: Any) -> Any:
    """Build component ``name`` of ``kind`` with ``options`` validated by its options class.

    Environments are built as ``factory(**options)``; other kinds as ``factory(options_obj, **kwargs)``
    (or ``factory(**kwargs)`` when the component has no options class).
    """
    spec = plugin_manager.spec(kind, name)
    opts = structure_options(spec, options or {}, path=f"{kind}:{name}")
    factory = spec.load_factory()
    if kind == "environment":
        return factory(**(attrs.asdict(opts, recurse=False) if opts is not None else {}))
    if opts is None:
        return factory(**kwargs)
    return factory(opts, **kwargs)


def build_selected(plugin_manager: SkyrlPluginManager, kind: str, selection: Selection, *args: Any,
                   **kwargs: Any) -> Any:
    """Build the component ``selection`` names, passing its already structured options object:
    ``factory(*args, options, **kwargs)`` (engines and backends take ``(model, options, ...)``)."""
    spec = plugin_manager.spec(kind, selection.name)
    options = selection.options
    if isinstance(options, dict):  # a Selection made in Python rather than by the config loader
        options = structure_options(spec, options, path=f"{kind}:{selection.name}")
    return spec.load_factory()(*args, options, **kwargs)
