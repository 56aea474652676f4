"""Options of the ``megatron`` training backend (``backend.options`` in the config).

Light module: no torch, no megatron at import time.
"""

from __future__ import annotations

from typing import Any

import attrs

from skyrl_core.config.validators import one_of, optional_positive_int, positive_int
from skyrl_core.lora_options import LoraOptions, lora_field


def _help(text: str) -> dict[str, Any]:
    return {"help": text}


@attrs.frozen(kw_only=True)
class MegatronOptions:
    """How the Megatron backend lays the model out over processes.

    ``world_size`` processes form ``world_size // tensor_parallel`` data-parallel replicas of a
    model split ``tensor_parallel`` ways; with ``expert_parallel`` > 1, groups of that many replicas
    split the experts of MoE layers between them. One process runs in the caller's process; more run
    as Ray actors on this machine.
    """

    tensor_parallel: int = attrs.field(default=1, validator=positive_int, metadata=_help("tensor-parallel degree"))
    world_size: int | None = attrs.field(
        default=None,
        validator=optional_positive_int,
        metadata=_help("number of processes (default: tensor_parallel); a multiple of tensor_parallel"),
    )
    expert_parallel: int = attrs.field(
        default=1,
        validator=positive_int,
        metadata=_help("expert-parallel degree (MoE models): experts split across this many data-parallel replicas"),
    )
    micro_batch_size: int | None = attrs.field(
        default=None, validator=optional_positive_int, metadata=_help("sequences per forward pass (default: trainer.micro_batch_size)")
    )
    mixed_precision: str = attrs.field(
        default="fp32",
        validator=one_of("fp32", "bf16"),
        metadata=_help("fp32, or bf16: bf16 parameters and compute with fp32 main parameters in megatron's optimizer (GPU only)"),
    )
    device: str = attrs.field(
        default="auto", validator=one_of("auto", "cpu", "cuda"), metadata=_help("cpu (gloo), cuda (nccl), or auto: cuda when available")
    )
    launcher: str = attrs.field(
        default="auto",
        validator=one_of("auto", "inprocess", "ray"),
        metadata=_help("inprocess (world_size 1 only), ray (one actor per process), or auto: inprocess for 1 process, else ray"),
    )
    torch_threads: int | None = attrs.field(
        default=None, validator=optional_positive_int, metadata=_help("torch CPU threads per Ray worker (default: torch's own)")
    )
    lora: LoraOptions | None = lora_field(
        "train a LoRA adapter ({rank, alpha, targets}) on frozen base weights (dense Llama/Qwen3, CPU); "
        "exported and saved weights are the adapter merged into the base (skyrl_core.lora.merged_weight)"
    )

    def __attrs_post_init__(self) -> None:
        world = self.processes
        if world % self.tensor_parallel:
            raise ValueError(
                f"backend.options.world_size ({world}) must be a multiple of tensor_parallel ({self.tensor_parallel})"
            )
        if self.data_parallel % self.expert_parallel:
            raise ValueError(
                f"backend.options.expert_parallel ({self.expert_parallel}) must divide the data-parallel degree "
                f"world_size / tensor_parallel ({self.data_parallel})"
            )
        if self.launcher == "inprocess" and world != 1:
            raise ValueError(
                f"backend.options.launcher 'inprocess' runs one process, but world_size is {world}; use 'ray' or 'auto'"
            )

    @property
    def processes(self) -> int:
        return self.world_size if self.world_size is not None else self.tensor_parallel

    @property
    def data_parallel(self) -> int:
        return self.processes // self.tensor_parallel
