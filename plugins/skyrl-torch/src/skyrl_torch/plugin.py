"""Registers the native engine. Imports only records: torch loads when the engine is built."""

from __future__ import annotations

from skyrl_core.plugins import hookimpl
from skyrl_core.plugins.records import InferenceEngineSpec


@hookimpl
def skyrl_register_inference_engines(register) -> None:
    register(
        InferenceEngineSpec(
            name="torch",
            factory="skyrl_torch.engine:TorchEngine",
            options="skyrl_torch.options:TorchEngineOptions",
            preflight="skyrl_torch.preflight:problems",
            description="native PyTorch engine: any Hugging Face causal LM, KV-cache slots, continuous batching",
        )
    )
