"""skyrl: a thin reinforcement-learning core for LLMs, extended by plugins.

Importing this package is cheap (no torch); the loaders below import what they build on demand.
"""

from __future__ import annotations

from typing import Any

__version__ = "0.1.0"


def load_policy_loss(name: str, **options: Any):
    """The registered policy loss ``name`` built with ``options`` (validated like config)."""
    from skyrl_core.plugins.building import build_component
    from skyrl_core.plugins.manager import get_plugin_manager

    return build_component(get_plugin_manager(), "policy_loss", name, options)


def load_advantage_estimator(name: str, **options: Any):
    """The registered advantage estimator ``name`` built with ``options``."""
    from skyrl_core.plugins.building import build_component
    from skyrl_core.plugins.manager import get_plugin_manager

    return build_component(get_plugin_manager(), "advantage_estimator", name, options)


def make_env(name: str, **options: Any):
    """A new instance of the registered environment ``name`` (pluggy or ``skyrl.environments``)."""
    from skyrl_core.plugins.building import build_component
    from skyrl_core.plugins.manager import get_plugin_manager

    return build_component(get_plugin_manager(), "environment", name, options)


__all__ = ["__version__", "load_advantage_estimator", "load_policy_loss", "make_env"]
