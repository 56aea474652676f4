"""Helpers shared by the skyrl-torch engine tests (dense and hybrid models)."""

from __future__ import annotations

from skyrl_torch.engine import TorchEngine


def record_forwards(eng: TorchEngine) -> list[tuple[int, int]]:
    """Patch ``eng`` to record the (rows, tokens per row) of every forward it runs."""
    shapes: list[tuple[int, int]] = []
    original = eng._forward_rows

    def recording(cache, rows, tokens, positions, **kwargs):
        shapes.append(tuple(tokens.shape))
        return original(cache, rows, tokens, positions, **kwargs)

    eng._forward_rows = recording
    return shapes


def prompt(length: int, offset: int = 0) -> list[int]:
    """A deterministic prompt of ``length`` in-vocabulary token ids."""
    return [65 + (offset + 7 * i) % 50 for i in range(length)]
