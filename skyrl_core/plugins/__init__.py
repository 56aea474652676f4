"""The plugin system: hook specs, registration records and the plugin manager."""

import pluggy

PROJECT_NAME = "skyrl"

hookspec = pluggy.HookspecMarker(PROJECT_NAME)
hookimpl = pluggy.HookimplMarker(PROJECT_NAME)

__all__ = ["PROJECT_NAME", "hookimpl", "hookspec"]
