"""Progress bars (tqdm) for steps, rollouts and evaluations, and one printed line per step."""

from __future__ import annotations

import contextlib
import sys
from typing import Callable, Iterator

from tqdm import tqdm


class Progress:
    """A step bar for the whole run, short-lived bars for each rollout and evaluation.

    With ``enabled=False`` no bar is drawn; the per-step lines are printed either way.
    """

    def __init__(self, *, enabled: bool, total: int, initial: int = 0) -> None:
        self.enabled = enabled
        self.total = total
        self.bar = tqdm(total=total, initial=initial, desc="steps", unit="step", disable=not enabled,
                        dynamic_ncols=True, file=sys.stderr)

    @contextlib.contextmanager
    def task(self, description: str, total: int) -> Iterator[Callable[[int], None]]:
        """A bar for ``total`` units of work; yields ``advance(done_so_far)``."""
        bar = tqdm(total=total, desc=description, leave=False, disable=not self.enabled, dynamic_ncols=True,
                   file=sys.stderr, position=1)

        def advance(done: int) -> None:
            bar.n = done
            bar.refresh()

        try:
            yield advance
        finally:
            bar.close()

    def step(self, step: int, text: str) -> None:
        self.bar.update(1)
        self.say(f"step {step}/{self.total} {text}")

    def say(self, text: str) -> None:
        tqdm.write(text, file=sys.stdout)

    def close(self) -> None:
        self.bar.close()
