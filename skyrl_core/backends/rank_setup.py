"""Helpers a training rank uses to set itself up: its device, the default process group, moving a
batch to its device, and asking a callable which keywords it takes.

Shared by the ranks of every backend plugin (FSDP, Megatron), so that they resolve ``device``
options, join process groups and report mismatches the same way.
"""

from __future__ import annotations

import inspect
from typing import Any

import attrs
import torch
import torch.distributed as dist

from skyrl_core.types import TrainingBatch


def wants_gpu(device: str) -> bool:
    """Whether a backend's ``device`` option (``auto``, ``cpu``, ``cuda``) puts its ranks on a GPU."""
    return device == "cuda" or (device == "auto" and torch.cuda.is_available())


def resolve_device(device: str) -> torch.device:
    """The ``torch.device`` of a backend's ``device`` option in this process."""
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda":
        if not torch.cuda.is_available():
            raise RuntimeError("backend option device='cuda' but no CUDA device is visible")
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def join_process_group(backend: str, rank: int, world_size: int, init_method: str | None, *, who: str) -> bool:
    """Make torch.distributed's default group this process as ``rank`` of ``world_size``.

    Initialises it with ``backend`` (over an in-memory store when ``init_method`` is None: one
    in-process rank, no port to pick) and returns True; or, when a group already exists, checks that
    it has this rank and world size and returns False (``who`` names the backend in the error).
    """
    if not dist.is_initialized():
        if init_method is None:
            dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
        else:
            dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world_size)
        return True
    if dist.get_world_size() != world_size or dist.get_rank() != rank:
        raise RuntimeError(
            f"a torch.distributed process group (rank {dist.get_rank()} of {dist.get_world_size()}) already "
            f"exists in this process; the {who} backend needs rank {rank} of {world_size}"
        )
    return False


def accepts_keyword(fn: Any, name: str) -> bool:
    """Whether ``fn`` takes a parameter ``name`` (False when its signature cannot be read)."""
    try:
        return name in inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False


def batch_to_device(batch: TrainingBatch, device: torch.device) -> TrainingBatch:
    """``batch`` with every tensor on ``device`` (``batch`` itself on the CPU)."""
    if device.type == "cpu":
        return batch
    moved = {
        f.name: value.to(device)
        for f in attrs.fields(TrainingBatch)
        if isinstance(value := getattr(batch, f.name), torch.Tensor)
    }
    return attrs.evolve(batch, **moved)


def use_memory_efficient_attention(model: Any) -> str:
    """Switch a transformers model from eager attention (which keeps every ``[heads, L, L]``
    probability matrix for backward: quadratic in sequence length) to SDPA (PyTorch's fused
    attention, keeping ``O(L)`` per head), with short bf16 calls on CPU written out where PyTorch's
    kernel is slow (``skyrl_core.ops.short_attention``, memory bounded by ``MAX_SCORES``); return
    the implementation in use. Call it before ``prepare_model``: installed ops fall back to the
    implementation set here. Models without SDPA support keep theirs."""
    from skyrl_core.ops.short_attention import ATTENTION_NAME, use_short_attention

    current = getattr(model.config, "_attn_implementation", None) or "eager"
    if current == "eager":
        try:
            model.set_attn_implementation("sdpa")
        except (ValueError, ImportError, AttributeError):
            return current
    elif current != "sdpa":
        return current
    return ATTENTION_NAME if use_short_attention(model) else "sdpa"
