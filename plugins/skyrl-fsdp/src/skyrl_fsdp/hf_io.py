"""Reading and writing Hugging Face model directories from full (unsharded) state dicts."""

from __future__ import annotations

import os
from typing import Any

import torch
from safetensors.torch import load_file, save_file

WEIGHTS_FILE = "model.safetensors"


def write_hf_dir(path: str, state_dict: dict[str, torch.Tensor], hf_config: Any, aliases: dict[str, str], tokenizer: Any = None) -> None:
    """Write ``config.json``, ``model.safetensors`` (tied aliases left out, as transformers expects)
    and the tokenizer, when it can save itself, into the existing directory ``path``."""
    tensors = {name: t.detach().contiguous() for name, t in state_dict.items() if name not in aliases}
    save_file(tensors, os.path.join(path, WEIGHTS_FILE), metadata={"format": "pt"})
    hf_config.save_pretrained(path)
    if tokenizer is not None and hasattr(tokenizer, "save_pretrained"):
        tokenizer.save_pretrained(path)


def read_hf_weights(path: str, aliases: dict[str, str]) -> dict[str, torch.Tensor]:
    """The weights ``write_hf_dir`` wrote, with tied aliases filled back in."""
    tensors = load_file(os.path.join(path, WEIGHTS_FILE))
    for alias, canonical in aliases.items():
        tensors.setdefault(alias, tensors[canonical])
    return tensors
