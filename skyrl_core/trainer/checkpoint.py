"""Checkpoints of a run: the backend's state plus the trainer's, written atomically.

Layout (``<output_dir>/checkpoints/``)::

    step_000004/
        backend/             whatever TrainingBackend.save_checkpoint writes (weights, optimizer, RNG)
        trainer_state.json   step, data position, KL coefficient, metrics history
        rng.pt               this process's Python, NumPy and torch RNG states
    latest                   the name of the newest complete checkpoint

A checkpoint directory appears only once complete (written under a temporary name, then renamed),
so a run killed while checkpointing leaves the previous checkpoint as the latest.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import tempfile
from typing import Any

CHECKPOINTS_DIR = "checkpoints"
LATEST_FILE = "latest"
STATE_FILE = "trainer_state.json"
RNG_FILE = "rng.pt"
BACKEND_DIR = "backend"
FORMAT = 1


def checkpoint_name(step: int) -> str:
    return f"step_{step:06d}"


def _rng_state() -> dict[str, Any]:
    import numpy as np
    import torch

    return {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}


def _set_rng_state(state: dict[str, Any]) -> None:
    import numpy as np
    import torch

    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])


def save_checkpoint(output_dir: str, step: int, backend: Any, trainer_state: dict[str, Any]) -> str:
    """Write the checkpoint of ``step`` and point ``latest`` at it; return its path."""
    import torch

    root = os.path.join(os.path.abspath(output_dir), CHECKPOINTS_DIR)
    os.makedirs(root, exist_ok=True)
    final = os.path.join(root, checkpoint_name(step))
    tmp = tempfile.mkdtemp(prefix=f".{checkpoint_name(step)}.tmp-", dir=root)
    try:
        backend.save_checkpoint(os.path.join(tmp, BACKEND_DIR))
        torch.save(_rng_state(), os.path.join(tmp, RNG_FILE))
        with open(os.path.join(tmp, STATE_FILE), "w", encoding="utf-8") as f:
            json.dump({"format": FORMAT, "step": step, **trainer_state}, f, sort_keys=True)
        if os.path.exists(final):
            shutil.rmtree(final)
        os.rename(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    pointer = os.path.join(root, f".{LATEST_FILE}.tmp")
    with open(pointer, "w", encoding="utf-8") as f:
        f.write(checkpoint_name(step) + "\n")
    os.replace(pointer, os.path.join(root, LATEST_FILE))
    return final


def resolve_checkpoint(path: str) -> str:
    """The checkpoint directory ``path`` names: a checkpoint itself, or a run directory (or its
    ``checkpoints/``) whose ``latest`` checkpoint is taken."""
    path = os.path.abspath(os.path.expanduser(path))
    if os.path.isfile(os.path.join(path, STATE_FILE)):
        return path
    for root in (path, os.path.join(path, CHECKPOINTS_DIR)):
        latest = os.path.join(root, LATEST_FILE)
        if os.path.isfile(latest):
            with open(latest, encoding="utf-8") as f:
                candidate = os.path.join(root, f.read().strip())
            if os.path.isfile(os.path.join(candidate, STATE_FILE)):
                return candidate
    raise FileNotFoundError(
        f"trainer.resume={path!r} is neither a checkpoint (a directory with {STATE_FILE}) nor a run "
        f"directory with {CHECKPOINTS_DIR}/{LATEST_FILE}"
    )


def load_checkpoint(path: str, backend: Any) -> dict[str, Any]:
    """Restore the backend and this process's RNG from checkpoint ``path``; return the trainer state."""
    import torch

    with open(os.path.join(path, STATE_FILE), encoding="utf-8") as f:
        state = json.load(f)
    if state.get("format") != FORMAT:
        raise ValueError(f"{path}: trainer checkpoint format {state.get('format')!r}, this trainer reads {FORMAT}")
    backend.load_checkpoint(os.path.join(path, BACKEND_DIR))
    _set_rng_state(torch.load(os.path.join(path, RNG_FILE), weights_only=False))
    return state
