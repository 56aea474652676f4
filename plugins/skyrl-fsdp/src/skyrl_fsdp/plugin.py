"""Registers the FSDP2 training backend. Imports only records: torch loads when the backend is built."""

from __future__ import annotations

from skyrl_core.plugins import hookimpl
from skyrl_core.plugins.records import TrainingBackendSpec


@hookimpl
def skyrl_register_training_backends(register) -> None:
    register(
        TrainingBackendSpec(
            name="fsdp",
            factory="skyrl_fsdp.backend:FSDPBackend",
            options="skyrl_fsdp.options:FSDPOptions",
            preflight="skyrl_fsdp.precision:problems",
            description="FSDP2 data-parallel training (gloo on CPU, nccl on GPU; N ranks as Ray actors)",
        )
    )
