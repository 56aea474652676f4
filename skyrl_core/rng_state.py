"""A process's random-number state (Python, NumPy, torch CPU and, where present, CUDA), captured
into a checkpoint and restored on resume, so that a resumed run draws what an uninterrupted one
would. The core's run checkpoints and every training backend's ranks use these two functions; a
backend with more generators (megatron-core's RNG tracker) adds its own keys beside them.

The captured dict holds only what ``skyrl_core.state_file`` stores without pickle (tensors, NumPy
arrays, tuples, numbers, strings).
"""

from __future__ import annotations

import random
from typing import Any


def capture_rng_state() -> dict[str, Any]:
    import numpy as np
    import torch

    state: dict[str, Any] = {"python": random.getstate(), "numpy": np.random.get_state(),
                             "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def restore_rng_state(state: dict[str, Any]) -> None:
    """Restore what ``capture_rng_state`` captured; a generator missing from ``state`` (a checkpoint
    written without it) keeps its current state. NumPy keys stored as a torch tensor are accepted."""
    import numpy as np
    import torch

    if "python" in state:
        random.setstate(_python_state(state["python"]))
    if "numpy" in state:
        kind, keys, pos, has_gauss, cached = state["numpy"]
        keys = keys.numpy() if isinstance(keys, torch.Tensor) else np.asarray(keys)
        np.random.set_state((kind, keys.astype(np.uint32), int(pos), int(has_gauss), float(cached)))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def _python_state(state: Any) -> tuple:
    # A state file gives tuples back as tuples, all_gather_object as they were; JSON would give lists.
    version, internal, gauss = state
    return int(version), tuple(int(x) for x in internal), gauss
