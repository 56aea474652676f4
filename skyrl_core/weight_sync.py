"""Moving the trainer's weights into an engine in another process, two ways (the third, in-process
tensors, is ``engine.update_weights(backend.export_weights())``):

- **broadcast**: the trainer (rank 0) and the engine process (rank 1) form a two-member gloo group
  of their own (a ``TCPStore`` rendezvous on loopback, not the default process group, so the trainer's
  FSDP group is untouched); the engine first gets the manifest (names, shapes, dtypes), then each
  tensor arrives by ``broadcast`` into a buffer it allocated;
- **checkpoint**: the trainer writes one safetensors file into a directory (to a temporary name,
  then renamed, so a reader never sees half a file) and the engine loads it.

``weights_digest`` is a SHA-256 over names and raw bytes: equal digests mean bit-equal weights.
"""

from __future__ import annotations

import datetime
import hashlib
import os
from typing import TYPE_CHECKING, Iterable, Iterator

if TYPE_CHECKING:
    import torch

Manifest = list[tuple[str, tuple[int, ...], str]]  # (name, shape, dtype name)


def manifest_of(named_tensors: Iterable[tuple[str, torch.Tensor]]) -> Manifest:
    return [(name, tuple(t.shape), str(t.dtype).removeprefix("torch.")) for name, t in named_tensors]


def weights_digest(named_tensors: Iterable[tuple[str, torch.Tensor]]) -> str:
    """SHA-256 of every (name, dtype, shape, raw bytes), in name order."""
    digest = hashlib.sha256()
    for name, t in sorted(named_tensors, key=lambda item: item[0]):
        t = t.detach().to("cpu").contiguous()
        digest.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        digest.update(t.view(-1).view(__import__("torch").uint8).numpy().tobytes())
    return digest.hexdigest()


class GlooPairHost:
    """Rank 0 (the trainer) of a two-member gloo group. Its rendezvous store listens on a port the
    kernel chose when it bound (port 0), so no other process can take the port between its choice
    and the bind (a port chosen free and bound later can be: two test workers, two runs). Give
    ``port`` to rank 1 (``join_gloo_pair``), then ``group()`` waits for it to join."""

    def __init__(self, host: str = "127.0.0.1", timeout_s: float = 120.0) -> None:
        import torch.distributed as dist

        self.timeout = datetime.timedelta(seconds=timeout_s)
        self.store = dist.TCPStore(host, 0, world_size=2, is_master=True, timeout=self.timeout, wait_for_workers=False)
        self.port = int(self.store.port)

    def group(self):
        import torch.distributed as dist

        return dist.ProcessGroupGloo(self.store, 0, 2, self.timeout)


def join_gloo_pair(host: str, port: int, timeout_s: float = 120.0):
    """Rank 1 (the engine process): the group of the ``GlooPairHost`` listening at ``host:port``."""
    import torch.distributed as dist

    timeout = datetime.timedelta(seconds=timeout_s)
    store = dist.TCPStore(host, port, world_size=2, is_master=False, timeout=timeout)
    return dist.ProcessGroupGloo(store, 1, 2, timeout)


def send_by_broadcast(group, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> int:
    """Rank 0: broadcast each tensor, in manifest order; returns the bytes sent."""
    sent = 0
    for _name, t in named_tensors:
        t = t.detach().to("cpu").contiguous()
        group.broadcast(t, 0).wait()
        sent += t.numel() * t.element_size()
    return sent


def receive_by_broadcast(group, manifest: Manifest) -> Iterator[tuple[str, torch.Tensor]]:
    """Rank 1: each tensor of ``manifest``, received into a fresh buffer."""
    import torch

    for name, shape, dtype in manifest:
        buffer = torch.empty(shape, dtype=getattr(torch, dtype))
        group.broadcast(buffer, 0).wait()
        yield name, buffer


def write_checkpoint(directory: str, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> str:
    """Write ``weights_v{version}.safetensors`` in ``directory`` atomically; returns its path."""
    from safetensors.torch import save_file

    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, f"weights_v{version:06d}.safetensors")
    partial = path + ".partial"
    # (clones: safetensors refuses tensors sharing storage, as tied embeddings do)
    save_file({name: t.detach().to("cpu").clone().contiguous() for name, t in named_tensors}, partial)
    os.replace(partial, path)
    return path


def read_checkpoint(path: str) -> Iterator[tuple[str, torch.Tensor]]:
    from safetensors import safe_open

    with safe_open(path, framework="pt") as f:
        for name in f.keys():
            yield name, f.get_tensor(name)
