"""Activation checkpointing of decoder layers: backward recomputes a layer's activations from its
input instead of storing them, so a long sequence holds one hidden state per layer, not every
intermediate tensor of every layer.

Applied by replacing each layer's ``forward`` on the instance (not by wrapping the module): names
of parameters and state-dict keys stay as they are, hooks on the module (FSDP's unshard/reshard)
still run around the checkpointed body, and the model's train/eval mode does not matter.
``checkpoint_layers`` does it for good (a backend configured with ``trainer.activation_checkpointing``);
``checkpointed_layers`` for one computation (a pass too long to keep every activation).
"""

from __future__ import annotations

import contextlib
import functools
from typing import Any, Iterable, Iterator

from torch.utils.checkpoint import checkpoint


def checkpoint_layers(layers: Iterable[Any]) -> int:
    """Checkpoint every module of ``layers``; return how many (idempotent)."""
    count = 0
    for layer in layers:
        if not getattr(layer, "_skyrl_checkpointed", False):
            body = layer.forward

            @functools.wraps(body)
            def checkpointed(*args: Any, _body: Any = body, **kwargs: Any) -> Any:
                return checkpoint(_body, *args, use_reentrant=False, **kwargs)

            layer.forward = checkpointed
            layer._skyrl_checkpointed = True
        count += 1
    return count


@contextlib.contextmanager
def checkpointed_layers(layers: Iterable[Any]) -> Iterator[None]:
    """Checkpoint ``layers`` inside the block, then give each its own ``forward`` back (layers that
    were checkpointed already stay so)."""
    changed = [layer for layer in layers if not getattr(layer, "_skyrl_checkpointed", False)]
    saved = [layer.__dict__.get("forward") for layer in changed]  # an instance-level forward, if any
    checkpoint_layers(changed)
    try:
        yield
    finally:
        for layer, forward in zip(changed, saved):
            del layer.forward, layer._skyrl_checkpointed
            if forward is not None:
                layer.forward = forward


def decoder_layers(model: Any) -> list[Any]:
    """The repeated decoder layers of a transformers causal LM (``model.model.layers``)."""
    layers = getattr(getattr(model, "model", None), "layers", None)
    if layers is None:
        raise ValueError(f"{type(model).__name__} has no model.layers: activation checkpointing cannot find its layers")
    return list(layers)
