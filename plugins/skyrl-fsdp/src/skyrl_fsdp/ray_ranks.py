"""Starting N ``FSDPRank``s as Ray actors on this machine, and calling them together."""

from __future__ import annotations

import os
import socket
from typing import Any, Sequence

import attrs

os.environ.setdefault("RAY_AUTH_MODE", "disabled")

import ray  # noqa: E402

from skyrl_fsdp.rank import FSDPRank  # noqa: E402

READY_TIMEOUT_S = 300


def ensure_ray(num_cpus: int) -> None:
    """Use the running Ray session, or start a local one (no dashboard, loopback only)."""
    if ray.is_initialized():
        return
    ray.init(
        address="local",
        include_dashboard=False,
        num_cpus=max(num_cpus, os.cpu_count() or 1),
        log_to_driver=True,
        runtime_env={"env_vars": {"RAY_AUTH_MODE": "disabled", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}},
    )


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start_ranks(model: Any, options: Any, trainer: Any, *, seed: int, use_gpu: bool) -> list[Any]:
    """Start ``options.world_size`` actors that rendezvous over TCP on loopback; wait until all are up."""
    world_size = options.world_size
    ensure_ray(world_size)
    if options.threads_per_rank is None:  # share this machine's cores between the ranks
        threads = max(1, (os.cpu_count() or 1) // world_size)
        options = attrs.evolve(options, threads_per_rank=threads)
    init_method = f"tcp://127.0.0.1:{_free_port()}"
    actor_class = ray.remote(num_cpus=1, num_gpus=1 if use_gpu else 0)(FSDPRank)
    actors = [
        actor_class.remote(model, options, trainer, seed=seed, rank=rank, world_size=world_size, init_method=init_method)
        for rank in range(world_size)
    ]
    try:
        gather([actor.ready.remote() for actor in actors], timeout=READY_TIMEOUT_S)
    except BaseException:
        kill(actors)
        raise
    return actors


def gather(refs: Sequence[Any], timeout: float | None = None) -> list[Any]:
    """Results of ``refs`` in order. Fails as soon as any one fails: the other ranks may be blocked
    in a collective waiting for it, so waiting for all of them could hang."""
    pending = list(refs)
    while pending:
        done, pending = ray.wait(pending, num_returns=1, timeout=timeout)
        if not done:
            raise TimeoutError(
                f"FSDP ranks did not answer within {timeout} s (Ray resources: {ray.available_resources()})"
            )
        ray.get(done[0])  # raises the rank's error
    return ray.get(list(refs))


def kill(actors: Sequence[Any]) -> None:
    for actor in actors:
        try:
            ray.kill(actor)
        except Exception:  # an actor that already died is fine
            pass
