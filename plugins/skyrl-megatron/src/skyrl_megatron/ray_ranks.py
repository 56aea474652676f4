"""Starting the backend's ranks as Ray actors on this machine, and calling them together."""

from __future__ import annotations

import os
import socket
from typing import Any, Sequence

import attrs

os.environ.setdefault("RAY_AUTH_MODE", "disabled")

import ray  # noqa: E402

from skyrl_core.local_ray import ensure_local_ray, skyrl_environment  # noqa: E402

from skyrl_megatron.rank import MegatronRank  # noqa: E402

READY_TIMEOUT_S = 300


def ensure_ray(num_cpus: int) -> None:
    """Use the running Ray session, or start a local one on loopback (see skyrl_core.local_ray)."""
    ensure_local_ray(num_cpus)


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start_ranks(model: Any, options: Any, trainer: Any, *, seed: int, use_gpu: bool) -> list[Any]:
    """``options.processes`` actors that meet over TCP on loopback; returns once all are built."""
    world = options.processes
    ensure_ray(world)
    if options.torch_threads is None:  # share this machine's cores between the ranks
        options = attrs.evolve(options, torch_threads=max(1, (os.cpu_count() or 1) // world))
    init_method = f"tcp://127.0.0.1:{_free_port()}"
    # No CPU reservation: each rank's threads are set by torch_threads, and reserving cores would
    # keep a second backend (a reference model, a test's second run) from starting on a small machine.
    actor_class = ray.remote(num_cpus=0, num_gpus=1 if use_gpu else 0)(MegatronRank)
    actors = [
        actor_class.remote(
            model, options, trainer, seed=seed, rank=rank, init_method=init_method, environ=skyrl_environment()
        )
        for rank in range(world)
    ]
    try:
        gather([actor.ready.remote() for actor in actors], timeout=READY_TIMEOUT_S)
    except BaseException:
        kill(actors)
        raise
    return actors


def gather(refs: Sequence[Any], timeout: float | None = None) -> list[Any]:
    """Results in order; raises the first failure at once (the other ranks may be blocked in a
    collective with the failed one, so waiting for all could hang)."""
    pending = list(refs)
    while pending:
        done, pending = ray.wait(pending, num_returns=1, timeout=timeout)
        if not done:
            raise TimeoutError(f"Megatron ranks did not answer within {timeout} s (Ray resources: {ray.available_resources()})")
        ray.get(done[0])
    return ray.get(list(refs))


def kill(actors: Sequence[Any]) -> None:
    for actor in actors:
        try:
            ray.kill(actor)
        except Exception:  # an actor that already died is fine
            pass
