"""A failed step says what it was doing: the step number and the phase, and where the metrics of
the steps before it are (written and closed after every step, so nothing finished is lost)."""

from __future__ import annotations

from types import TracebackType
from typing import Callable

from skyrl_core.config.errors import ConfigError


class StepFailedError(RuntimeError):
    """Training stopped with an error; ``step`` and ``phase`` say where (the cause is chained)."""

    def __init__(self, step: int, phase: str, cause: BaseException, metrics_path: str) -> None:
        self.step, self.phase = step, phase
        where = f"step {step}" if step else "setup"
        super().__init__(f"{where} failed while {phase}: {type(cause).__name__}: {cause} "
                         f"(metrics of the finished steps: {metrics_path})")


class RunActivity:
    """What the run is doing now: the loop sets it at each phase; ``on_exit`` (an ``ExitStack``
    callback) turns an error into a ``StepFailedError`` naming it."""

    def __init__(self, metrics_path: str, passes_through: tuple[type[BaseException], ...] = ()) -> None:
        self.step, self.phase = 0, "setting up"
        self.metrics_path = metrics_path
        # errors that already say where and what (config errors, divergence) reach the caller as they are
        self.passes_through = (ConfigError, StepFailedError, *passes_through)

    def now(self, step: int, phase: str) -> None:
        self.step, self.phase = step, phase

    @property
    def on_exit(self) -> Callable[[type[BaseException] | None, BaseException | None, TracebackType | None], bool]:
        def name_the_phase(exc_type, exc, tb) -> bool:
            if isinstance(exc, Exception) and not isinstance(exc, self.passes_through):
                raise StepFailedError(self.step, self.phase, exc, self.metrics_path) from exc
            return False

        return name_the_phase
