"""Options of the FSDP2 backend (``backend: {name: fsdp, options: {...}}``). Light: no torch import."""

from __future__ import annotations

from typing import Any

import attrs

from skyrl_core.config.validators import boolean, one_of, optional_positive_int, positive_int
from skyrl_core.lora_options import LoraOptions, lora_field  # (shared with skyrl-megatron; importable from here as before)

PRECISIONS = ("auto", "fp32", "bf16")
DEVICES = ("auto", "cpu", "cuda")
CPU_GEMMS = ("auto", "onednn", "torch")  # skyrl_core.ops.gemm_choice.CPU_GEMMS (this module imports no torch)


@attrs.frozen(kw_only=True)
class FSDPOptions:
    """How the FSDP2 backend shards, computes and places ranks."""

    world_size: int = attrs.field(
        default=1,
        validator=positive_int,
        metadata={"help": "data-parallel ranks; 1 runs in-process, N > 1 runs N Ray actors on this machine"},
    )
    mixed_precision: str = attrs.field(
        default="auto",
        validator=one_of(*PRECISIONS),
        metadata={
            "help": "auto: follow model.dtype (bfloat16: bf16 compute with fp32 master weights, gradient reduction "
            "and optimizer; float32: fp32); fp32 or bf16 must agree with model.dtype (refused otherwise)"
        },
    )
    device: str = attrs.field(
        default="auto",
        validator=one_of(*DEVICES),
        metadata={"help": "auto: cuda (nccl) when a GPU is visible, else cpu (gloo)"},
    )
    threads_per_rank: int | None = attrs.field(
        default=None,
        validator=optional_positive_int,
        metadata={
            "help": "torch threads in each Ray rank (default: CPU cores / world_size); "
            "the in-process rank of world_size 1 leaves the caller's setting alone unless this is set"
        },
    )
    cpu_gemm: str = attrs.field(
        default="auto",
        validator=one_of(*CPU_GEMMS),
        metadata={
            "help": "fp32 matrix products on CPU: auto (the faster of the two on this machine, measured once and "
            "kept in $SKYRL_CACHE_DIR/cpu_gemm.json), onednn (forward and backward on oneDNN) or torch (F.linear, "
            "PyTorch's BLAS); see benchmarks/cpu_gemm.py; IsoExec overrides all three"
        },
    )
    reshard_after_forward: bool = attrs.field(
        default=True,
        metadata={"help": "free gathered parameters after forward (less memory, one more all-gather in backward)"},
    )
    keep_gathered_params: bool = attrs.field(
        default=False,
        validator=boolean,
        metadata={
            "help": "gather the parameters once per forward / forward_backward call and keep them across its "
            "micro-batches (same bits; fewer copies and casts, the whole model in the compute dtype held for "
            "the call) instead of gathering per micro-batch, once or twice"
        },
    )
    share_prompts: bool = attrs.field(
        default=True,
        validator=boolean,
        metadata={
            "help": "rows with the same prompt (a GRPO group) go in one micro-batch and are computed as one sequence, "
            "the prompt once, each response seeing the prompt and itself (skyrl_core.ops.shared_prompts; same "
            "function, rounding aside). Only under the model's own attention: a plugin's attention (IsoExec) "
            "keeps rows apart"
        },
    )
    reuse_workers: bool = attrs.field(
        default=False,
        metadata={
            "help": "world_size > 1: on close, keep the rank processes idle in this Ray session for the next "
            "backend instead of killing them (saves a process start and imports per rank)"
        },
    )
    lora: LoraOptions | None = lora_field(
        "train a LoRA adapter ({rank, alpha, targets}) on frozen base weights; exported and saved "
        "weights are the adapter merged into the base (skyrl_core.lora.merged_weight)"
    )
