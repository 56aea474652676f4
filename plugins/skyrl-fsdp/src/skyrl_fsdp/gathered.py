"""Gather the parameters once per call instead of once or twice per micro-batch
(``backend.options.keep_gathered_params``).

FSDP2 gathers a module's parameters before its forward (casting the fp32 shards to bf16 under
``mixed_precision: bf16``), frees them after forward (``reshard_after_forward``), gathers again for
backward and frees them after backward. Over a call's micro-batches that is two gathers of the whole
model per micro-batch in ``forward_backward`` and one in the scoring ``forward``: on one rank every
gather is a full copy (and cast) of the weights in memory, about a tenth of a bf16 SmolLM2 step on
a 2-core CPU. Kept gathered, the parameters are copied once per call and freed after the last
micro-batch's backward (or, without backward, after the call), before the optimizer changes the
shards. The same values feed every product, so the bits do not change; the price is the whole
model in the compute dtype held for the call (what one layer at a time cost before).
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator

from torch.distributed.fsdp import FSDPModule


def _fsdp_modules(model: Any) -> list[FSDPModule]:
    return [m for m in model.modules() if isinstance(m, FSDPModule)]


@contextlib.contextmanager
def gathered_for_call(model: Any, *, enabled: bool, reshard_after_forward: bool) -> Iterator[Callable[[], None]]:
    """Within the block, parameters gathered by a forward stay gathered across micro-batches when
    ``enabled``. Yields ``before_last_backward()``: call it before the last micro-batch's backward,
    so that backward frees them. On exit everything is freed and every module's resharding is set back
    to ``reshard_after_forward`` (the backend's option, which FSDP applies to the root too) and to
    resharding after backward."""
    if not enabled:
        yield lambda: None
        return
    modules = _fsdp_modules(model)
    for module in modules:
        module.set_reshard_after_forward(False, recurse=False)
        module.set_reshard_after_backward(False, recurse=False)

    def before_last_backward() -> None:
        for module in modules:
            module.set_reshard_after_backward(True, recurse=False)

    try:
        yield before_last_backward
    finally:
        for module in modules:
            module.set_reshard_after_forward(reshard_after_forward, recurse=False)
            module.set_reshard_after_backward(True, recurse=False)
            module.reshard()
