"""What the ``megatron`` backend needs, checked before a run: megatron-core installed, and tensor- and
expert-parallel degrees the model can be split by (read from the model's config only)."""

from __future__ import annotations

import importlib.util
import os
from typing import Any

from skyrl_megatron.layout import check_parallel, layout_from_hf_config


def problems(config: Any, options: Any) -> list[str]:
    if importlib.util.find_spec("megatron") is None or importlib.util.find_spec("megatron.core") is None:
        return ["needs megatron-core, which is not installed (pip install megatron-core)"]
    precision = precision_problem(config.model.dtype, options)
    if precision is not None:
        return [precision]
    hf_config = _hf_config(config.model)
    if hf_config is None:
        return []  # no readable model config yet: the model.path check reports it
    tensor_parallel = int(getattr(options, "tensor_parallel", 1))
    expert_parallel = int(getattr(options, "expert_parallel", 1))
    try:
        layout = layout_from_hf_config(hf_config)
        check_parallel(layout, tensor_parallel=tensor_parallel, expert_parallel=expert_parallel)
    except ValueError as exc:
        return [f"{exc} (backend.options.tensor_parallel / expert_parallel)"]
    return []


def precision_problem(model_dtype: str, options: Any) -> str | None:
    """``model.dtype`` chooses the trainer's compute dtype too: bfloat16 needs megatron's bf16 (its
    mixed-precision optimizer, CUDA only); an explicit ``mixed_precision`` must agree with it."""
    precision = getattr(options, "mixed_precision", "fp32")
    if model_dtype == "bfloat16" and getattr(options, "device", "auto") == "cpu":
        return ("model.dtype: 'bfloat16' needs megatron's bf16 mixed-precision optimizer, which needs CUDA "
                "(backend.options.device is 'cpu'); on CPU train bf16 with backend fsdp, or use model.dtype: float32")
    wanted = "bf16" if model_dtype == "bfloat16" else "fp32"
    if precision != wanted:
        return (f"backend.options.mixed_precision: {precision!r} contradicts model.dtype: {model_dtype!r} (the engine "
                f"would sample in another dtype than the trainer computes in); set backend.options.mixed_precision: "
                f"{wanted!r}{' (CUDA only)' if wanted == 'bf16' else ''}, or model.dtype to match")
    return None


def _hf_config(model: Any) -> Any:
    from skyrl_core.models import build_hf_config

    if model.config is not None:
        return build_hf_config(dict(model.config))
    path = os.path.expanduser(model.path or "")
    if not os.path.isfile(os.path.join(path, "config.json")):
        return None
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(path)
