"""Writing a Hugging Face model directory from a full state dict."""

from __future__ import annotations

import os
from typing import Any

import torch
from safetensors.torch import save_file

WEIGHTS_FILE = "model.safetensors"


def write_hf_dir(path: str, state_dict: dict[str, torch.Tensor], hf_config: Any, *, tied: bool) -> None:
    """``config.json`` and ``model.safetensors`` into the existing directory ``path``; with tied
    embeddings ``lm_head.weight`` is left out, as transformers writes and expects it."""
    tensors = {
        name: t.detach().contiguous()
        for name, t in state_dict.items()
        if not (tied and name == "lm_head.weight")
    }
    save_file(tensors, os.path.join(path, WEIGHTS_FILE), metadata={"format": "pt"})
    hf_config.save_pretrained(path)
