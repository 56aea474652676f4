"""Config: the attrs schema, YAML + overrides loading, and errors that name key paths."""

from skyrl_core.config.errors import ConfigError
from skyrl_core.config.loader import load_config
from skyrl_core.config.schema import Config

__all__ = ["Config", "ConfigError", "load_config"]
