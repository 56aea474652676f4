"""Metrics loggers selected by ``trainer.loggers``: the shared plugin machinery.

A logger is a *sink* (``MetricsSink``: ``log(step, metrics)`` and ``close()``) plus a
``LoggerPlugin`` that registers its name and drives it from the run events
(``skyrl_on_run_start`` / ``skyrl_on_eval_end`` / ``skyrl_on_step_end`` / ``skyrl_on_run_end``).
The sink is built, and its library imported, only when the run selects its name; a sink that
cannot start refuses the run at ``skyrl_on_run_start``, before any training, with a
``ConfigError`` on ``trainer.loggers``.

Every logger receives the records of ``metrics.jsonl`` with the same values: numbers only (no
``step`` key, no missing values), each value once. An evaluation at step ``k`` is reported by
``skyrl_on_eval_end`` and its keys are then left out of the step record of ``k`` (which repeats
them), so a logger never sees one metric twice for one step.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any, Protocol

from skyrl_core.config.errors import ConfigError, ConfigIssue
from skyrl_core.plugins import hookimpl
from skyrl_core.plugins.records import LoggerSpec

if TYPE_CHECKING:
    from skyrl_core.config.schema import Config


class MetricsSink(Protocol):
    def log(self, step: int, metrics: dict[str, float]) -> None: ...

    def close(self) -> None: ...


def selected_loggers(config: Config) -> tuple[str, ...]:
    """The names in ``config.trainer.loggers`` (any config with a ``trainer`` section)."""
    return tuple(getattr(getattr(config, "trainer", None), "loggers", ()) or ())


def loggable(metrics: dict[str, Any]) -> dict[str, float]:
    """The values of a metrics record a logger receives: finite-or-infinite numbers as
    metrics.jsonl stores them (infinities as +-1e308, NaN left out), without ``step``."""
    out: dict[str, float] = {}
    for key, value in metrics.items():
        if key == "step" or isinstance(value, bool) or not isinstance(value, (int, float)):
            continue
        if math.isnan(value):
            continue
        out[key] = float(value) if math.isfinite(value) else (1e308 if value > 0 else -1e308)
    return out


class LoggerPlugin:
    """The pluggy plugin of one logger: registers ``spec`` and feeds its sink the run's metrics.

    One instance per logger per process (an entry point names it); a new run closes the previous
    run's sink first.
    """

    def __init__(self, spec: LoggerSpec) -> None:
        self.spec = spec
        self.sink: MetricsSink | None = None
        self._eval_keys: tuple[int, set[str]] = (-1, set())

    @hookimpl
    def skyrl_register_loggers(self, register: Any) -> None:
        register(self.spec)

    @hookimpl
    def skyrl_on_run_start(self, config: Config, run_dir: str) -> None:
        self._close()
        if self.spec.name not in selected_loggers(config):
            return
        try:
            self.sink = self.spec.load_factory()(run_dir, config)
        except Exception as exc:
            raise ConfigError([ConfigIssue(
                "trainer.loggers", f"logger {self.spec.name!r} failed to start: {type(exc).__name__}: {exc}")]) from exc

    @hookimpl
    def skyrl_on_eval_end(self, step: int, metrics: dict[str, float]) -> None:
        if self.sink is None:
            return
        values = loggable(metrics)
        self._eval_keys = (step, set(values))
        if values:
            self.sink.log(step, values)

    @hookimpl
    def skyrl_on_step_end(self, step: int, metrics: dict[str, float]) -> None:
        if self.sink is None:
            return
        already = self._eval_keys[1] if self._eval_keys[0] == step else set()
        values = {k: v for k, v in loggable(metrics).items() if k not in already}
        if values:
            self.sink.log(step, values)

    @hookimpl
    def skyrl_on_run_end(self, metrics: dict[str, float], run_dir: str) -> None:
        self._close()

    def _close(self) -> None:
        sink, self.sink, self._eval_keys = self.sink, None, (-1, set())
        if sink is not None:
            sink.close()
