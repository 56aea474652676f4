"""Whether IsoExec is on in this process (light: no torch).

Without an explicit ``configure``, IsoExec is on when ``SKYRL_ISOEXEC`` is ``1``/``true``.
``configure`` (called with the run's resolved config section, the CLI or tests) takes precedence
and mirrors the decision into ``SKYRL_ISOEXEC``, so that processes started afterwards (FSDP ranks,
engine workers) agree with this one. The precedence rule itself is in ``skyrl_isoexec.config``.
"""

from __future__ import annotations

import contextlib
import itertools
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


_scopes = itertools.count()

# What each run adopted over (``adopt``), by run directory: ``release`` puts it back.
_adopted: dict[str, list[tuple[IsoExecConfig | None, str | None]]] = {}


def adopt(config: IsoExecConfig | dict | None, run: str) -> None:
    """``configure(config)`` for the run ``run`` (its directory) until ``release(run)``; None keeps
    the present state. A run ends with ``release`` however it ends (``skyrl_on_run_exit``), so a
    second run in the same process (a notebook, a test session) starts where the first one did,
    not with the first one's switch still on."""
    _adopted.setdefault(run, []).append((_config, os.environ.get(ENV_VAR)))
    if config is not None:
        configure(config)


def release(run: str) -> None:
    """Undo ``adopt(..., run)``: the explicit config and ``SKYRL_ISOEXEC`` as they were before it
    (nothing if ``run`` adopted nothing)."""
    stack = _adopted.get(run)
    if not stack:
        return
    previous, saved_env = stack.pop()
    if not stack:
        del _adopted[run]
    configure(previous)
    if saved_env is None:
        os.environ.pop(ENV_VAR, None)
    else:
        os.environ[ENV_VAR] = saved_env


@contextlib.contextmanager
def enabled_scope(on: bool) -> Iterator[None]:
    """Run the body with IsoExec forced on or off (runtimes prepared inside keep what they got)."""
    with adopted(IsoExecConfig(enabled=on)):
        yield


@contextlib.contextmanager
def adopted(config: IsoExecConfig | dict | None) -> Iterator[None]:
    """``adopt`` for the body only."""
    scope = f"<scope {next(_scopes)}>"
    adopt(config, scope)
    try:
        yield
    finally:
        release(scope)
