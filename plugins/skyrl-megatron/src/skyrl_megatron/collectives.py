"""Collectives over a process group, shared by the rank and the LoRA adapter's export."""

from __future__ import annotations

import torch
import torch.distributed as dist


def all_gather(t: torch.Tensor, group) -> list[torch.Tensor]:
    """Every rank's ``t`` in group-rank order (``[t]`` alone in a group of one: no collective)."""
    if dist.get_world_size(group) == 1:
        return [t]
    parts = [torch.empty_like(t) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, t, group=group)
    return parts
