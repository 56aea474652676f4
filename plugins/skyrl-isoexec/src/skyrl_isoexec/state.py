"""Whether IsoExec is on in this process (light: no torch).

Without an explicit ``configure``, IsoExec is on when ``SKYRL_ISOEXEC`` is ``1``/``true``.
``configure`` (called with the run's resolved config section, the CLI or tests) takes precedence
and mirrors the decision into ``SKYRL_ISOEXEC``, so that processes started afterwards (FSDP ranks,
engine workers) agree with this one. The precedence rule itself is in ``skyrl_isoexec.config``.
"""

from __future__ import annotations

import contextlib
import os
from typing import Iterator

from skyrl_isoexec.config import ENV_VAR, IsoExecConfig, env_enabled

_config: IsoExecConfig | None = None


def configure(config: IsoExecConfig | dict | None) -> IsoExecConfig | None:
    """Adopt ``config`` (an ``IsoExecConfig`` or a dict of its fields); None returns to the
    environment variable alone. Returns the previous explicit config."""
    global _config
    previous = _config
    if isinstance(config, dict):
        config = IsoExecConfig(**config)
    _config = config
    if config is not None:
        if config.enabled:
            os.environ[ENV_VAR] = "1"
        else:
            os.environ.pop(ENV_VAR, None)
    return previous


def current() -> IsoExecConfig:
    """The effective config."""
    if _config is not None:
        return _config
    return IsoExecConfig()  # enabled: from SKYRL_ISOEXEC


def enabled() -> bool:
    return current().enabled


@contextlib.contextmanager
def enabled_scope(on: bool) -> Iterator[None]:
    """Run the body with IsoExec forced on or off (runtimes prepared inside keep what they got)."""
    saved_env = os.environ.get(ENV_VAR)
    previous = configure(IsoExecConfig(enabled=on))
    try:
        yield
    finally:
        configure(previous)
        if saved_env is None:
            os.environ.pop(ENV_VAR, None)
        else:
            os.environ[ENV_VAR] = saved_env
