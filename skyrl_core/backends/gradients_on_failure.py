"""A training call that fails adds no gradient: the gradients it found are put back.

A ``forward_backward`` runs several passes and each adds its gradients as it ends, so a failure in
a later pass (a loss that raises, memory running out, a failure inside backward) would leave the
earlier passes' part of a batch in the gradients, which the next optimizer step would apply. The
gradients found are copied only where there are any (a caller accumulating over calls; after an
optimizer step there are none), since backward adds into an existing gradient in place.
"""

from __future__ import annotations

import contextlib
from typing import Iterable, Iterator

import torch


@contextlib.contextmanager
def gradients_restored_on_failure(parameters: Iterable[torch.nn.Parameter]) -> Iterator[None]:
    """Run the block; if it raises, give every parameter of ``parameters`` the gradient it had
    before the block (the same values, or none), then re-raise."""
    params = list(parameters)
    found = {p: p.grad.detach().clone() for p in params if p.grad is not None}
    try:
        yield
    except BaseException:
        for p in params:
            p.grad = found.get(p)
        raise
