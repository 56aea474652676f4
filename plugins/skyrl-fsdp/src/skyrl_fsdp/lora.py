"""LoRA in the FSDP backend (``backend.options.lora: {rank, alpha, targets}``).

The rank injects one peft adapter (``skyrl_core.lora``) after preparing the op sites, freezes the
base weights, and trains only the adapter (AdamW skips tensors without gradients). What leaves the
backend is always a plain Hugging Face state dict: ``hf_state_dict`` merges the adapter into the base
weights (``skyrl_core.lora.merged_weight``), so weight sync to an engine, ``save_hf`` and the
checkpoint's model directory need no LoRA support anywhere else. A checkpoint also keeps the adapter
itself (``ADAPTER_FILE``): resuming loads it onto the same base weights, so it continues exactly.
"""

from __future__ import annotations

import os
from typing import Any

import torch

from skyrl_core import lora
from skyrl_fsdp.options import LoraOptions

ADAPTER = "default"
ADAPTER_FILE = "lora_adapter.safetensors"


def apply_lora(model: torch.nn.Module, options: LoraOptions, seed: int) -> None:
    modules = lora.target_modules(model, options.targets)
    model.requires_grad_(False)
    lora.add_adapter(model, ADAPTER, rank=options.rank, alpha=options.alpha, modules=modules, seed=seed)
    lora.select(model, ADAPTER)


def is_adapter_tensor(name: str) -> bool:
    return f".lora_A.{ADAPTER}." in name or f".lora_B.{ADAPTER}." in name


def hf_state_dict(state: dict[str, torch.Tensor], options: LoraOptions) -> dict[str, torch.Tensor]:
    """A full state dict of the LoRA model (peft names) as the Hugging Face state dict of the
    merged model: ``<m>.base_layer.weight`` + adapter -> ``<m>.weight``; adapter tensors dropped."""
    scale = torch.tensor(options.alpha / options.rank, dtype=torch.float32)
    out = {name.replace(".base_layer.", "."): t for name, t in state.items() if not is_adapter_tensor(name)}
    suffix = f".lora_A.{ADAPTER}.weight"
    for name, lora_a in state.items():
        if name.endswith(suffix):
            module = name[: -len(suffix)]
            lora_b = state[f"{module}.lora_B.{ADAPTER}.weight"]
            out[f"{module}.weight"] = lora.merged_weight(out[f"{module}.weight"], lora_a, lora_b, scale)
    return out


def save_adapter(path: str, state: dict[str, torch.Tensor]) -> None:
    from safetensors.torch import save_file

    save_file({k: v.contiguous() for k, v in state.items() if is_adapter_tensor(k)}, os.path.join(path, ADAPTER_FILE))


def read_adapter(path: str) -> dict[str, Any]:
    from safetensors.torch import load_file

    file = os.path.join(path, ADAPTER_FILE)
    if not os.path.exists(file):
        raise ValueError(f"{path}: no {ADAPTER_FILE}; this checkpoint was not saved with backend.options.lora")
    return load_file(file)
