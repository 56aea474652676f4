"""Registers the ``megatron`` training backend. Imports records only (no torch, no megatron)."""

from __future__ import annotations

from skyrl_core.plugins import hookimpl
from skyrl_core.plugins.records import TrainingBackendSpec


@hookimpl
def skyrl_register_training_backends(register) -> None:
    register(
        TrainingBackendSpec(
            name="megatron",
            factory="skyrl_megatron.backend:MegatronBackend",
            options="skyrl_megatron.options:MegatronOptions",
            preflight="skyrl_megatron.preflight:problems",
            description="Megatron-core GPT with tensor and data parallelism (gloo on CPU, nccl + Transformer Engine on GPU)",
        )
    )
