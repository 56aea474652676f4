"""skyrl_core.weight_sync without Ray: a gloo pair (two threads here, two processes in use) moves
every tensor bit for bit; a checkpoint round-trips bit for bit, tied tensors included, atomically."""

from __future__ import annotations

import threading

import pytest
import torch

from skyrl_core.weight_sync import (GlooPairHost, join_gloo_pair, manifest_of, read_checkpoint, receive_by_broadcast, send_by_broadcast,
                                    weights_digest, write_checkpoint)


def _weights() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    shared = torch.randn(16, 8, generator=gen)
    return {"embed.weight": shared, "lm_head.weight": shared,  # tied: one storage, two names
            "layer.bias": torch.randn(8, generator=gen), "half": torch.randn(3, 5, generator=gen).to(torch.bfloat16)}


def test_broadcast_pair_moves_every_tensor_bit_for_bit():
    weights = _weights()
    host = GlooPairHost("127.0.0.1", timeout_s=30)
    received: dict[str, torch.Tensor] = {}

    def engine_side() -> None:
        group = join_gloo_pair("127.0.0.1", host.port, timeout_s=30)
        received.update(receive_by_broadcast(group, manifest_of(weights.items())))

    thread = threading.Thread(target=engine_side)
    thread.start()
    sent = send_by_broadcast(host.group(), weights.items())
    thread.join(timeout=30)
    assert sent == sum(t.numel() * t.element_size() for t in weights.values())
    assert weights_digest(received.items()) == weights_digest(weights.items())
    received["layer.bias"].view(torch.int32)[0] ^= 1  # negative control: one flipped bit shows
    assert weights_digest(received.items()) != weights_digest(weights.items())


def test_checkpoint_round_trip_is_bit_equal_and_atomic(tmp_path):
    weights = _weights()
    path = write_checkpoint(str(tmp_path), weights.items(), version=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["weights_v000002.safetensors"]
    assert weights_digest(read_checkpoint(path)) == weights_digest(weights.items())


def test_the_pair_hosts_port_is_held_from_the_moment_it_is_known():
    """Rank 0 listens on a port the kernel chose as it bound: no other process can take it before
    rank 1 joins (a port chosen free and bound later could be taken in between)."""
    import errno
    import socket

    host = GlooPairHost("127.0.0.1", timeout_s=30)
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as other:
        with pytest.raises(OSError) as taken:
            other.bind(("127.0.0.1", host.port))
    assert taken.value.errno == errno.EADDRINUSE
