"""Which dataset rows each training step uses, as a position that checkpoints can restore."""

from __future__ import annotations

from typing import Any, Sequence

import attrs


@attrs.define
class PromptSampler:
    """Walks the rows epoch after epoch, each epoch in an order fixed by ``(seed, epoch)``.

    ``state()`` is ``{"epoch", "position"}``; ``load_state`` restores it, so a resumed run draws
    exactly the rows the uninterrupted one would have.
    """

    rows: Sequence[dict[str, Any]]
    seed: int
    shuffle: bool = True
    epoch: int = 0
    position: int = 0
    _order: list[int] | None = None

    def __attrs_post_init__(self) -> None:
        if not self.rows:
            raise ValueError("the training dataset has no rows")

    def _epoch_order(self) -> list[int]:
        if self._order is None:
            import numpy as np

            indices = np.arange(len(self.rows))
            if self.shuffle:
                indices = np.random.default_rng([self.seed, self.epoch]).permutation(len(self.rows))
            self._order = [int(i) for i in indices]
        return self._order

    def next_rows(self, count: int) -> list[dict[str, Any]]:
        out = []
        while len(out) < count:
            if self.position == len(self.rows):
                self.epoch, self.position, self._order = self.epoch + 1, 0, None
            out.append(self.rows[self._epoch_order()[self.position]])
            self.position += 1
        return out

    def state(self) -> dict[str, int]:
        return {"epoch": self.epoch, "position": self.position}

    def load_state(self, state: dict[str, int]) -> None:
        self.epoch, self.position, self._order = int(state["epoch"]), int(state["position"]), None
