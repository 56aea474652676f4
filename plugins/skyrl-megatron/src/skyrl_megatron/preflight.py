"""What the ``megatron`` backend needs, checked before a run: megatron-core installed, and a
tensor-parallel degree that divides the model's heads and MLP (read from the model's config only)."""

from __future__ import annotations

import importlib.util
import os
from typing import Any

from skyrl_megatron.layout import layout_from_hf_config


def problems(config: Any, options: Any) -> list[str]:
    if importlib.util.find_spec("megatron") is None or importlib.util.find_spec("megatron.core") is None:
        return ["needs megatron-core, which is not installed (pip install megatron-core)"]
    hf_config = _hf_config(config.model)
    if hf_config is None:
        return []  # no readable model config yet: the model.path check reports it
    try:
        layout_from_hf_config(hf_config).check_tensor_parallel(int(getattr(options, "tensor_parallel", 1)))
    except ValueError as exc:
        return [f"{exc} (backend.options.tensor_parallel)"]
    return []


def _hf_config(model: Any) -> Any:
    from skyrl_core.models import build_hf_config

    if model.config is not None:
        return build_hf_config(dict(model.config))
    path = os.path.expanduser(model.path or "")
    if not os.path.isfile(os.path.join(path, "config.json")):
        return None
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(path)
