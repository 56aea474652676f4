"""What the ``sglang`` engine needs from this machine, checked before a run (no SGLang import)."""

from __future__ import annotations

import importlib.util
from typing import Any


def problems(config: Any, options: Any) -> list[str]:
    import torch

    found = []
    if not torch.cuda.is_available():
        found.append("SGLang runs on CUDA GPUs only and this machine has none; on CPU use engine: vllm or torch")
    if importlib.util.find_spec("sglang") is None:
        found.append("needs the sglang package, which is not installed (pip install 'skyrl-sglang[gpu]')")
    return found
