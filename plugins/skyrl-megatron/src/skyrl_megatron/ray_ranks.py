"""Starting the backend's ranks as Ray actors on this machine, and calling them together."""

from __future__ import annotations

import os
from typing import Any, Sequence

import attrs

os.environ.setdefault("RAY_AUTH_MODE", "disabled")

import ray  # noqa: E402

from skyrl_core.backends import ray_actors  # noqa: E402
from skyrl_core.backends.ray_actors import kill  # noqa: E402
from skyrl_core.ports import on_a_free_port  # noqa: E402
from skyrl_core.local_ray import ensure_local_ray, skyrl_environment  # noqa: E402

from skyrl_megatron.rank import MegatronRank  # noqa: E402

READY_TIMEOUT_S = 300


def ensure_ray(num_cpus: int) -> None:
    """Use the running Ray session, or start a local one on loopback (see skyrl_core.local_ray)."""
    ensure_local_ray(num_cpus)


def start_ranks(model: Any, options: Any, trainer: Any, *, seed: int, use_gpu: bool) -> list[Any]:
    """``options.processes`` actors that meet over TCP on loopback; returns once all are built."""
    world = options.processes
    ensure_ray(world)
    if options.torch_threads is None:  # share this machine's cores between the ranks
        options = attrs.evolve(options, torch_threads=max(1, (os.cpu_count() or 1) // world))
    # No CPU reservation: each rank's threads are set by torch_threads, and reserving cores would
    # keep a second backend (a reference model, a test's second run) from starting on a small machine.
    actor_class = ray.remote(num_cpus=0, num_gpus=1 if use_gpu else 0)(MegatronRank)

    def start_on(port: int) -> list[Any]:
        actors = [
            actor_class.remote(
                model, options, trainer, seed=seed, rank=rank, init_method=f"tcp://127.0.0.1:{port}",
                environ=skyrl_environment(),
            )
            for rank in range(world)
        ]
        try:
            gather([actor.ready.remote() for actor in actors], timeout=READY_TIMEOUT_S)
        except BaseException:
            kill(actors)
            raise
        return actors

    return on_a_free_port(start_on)  # again on another port if one was taken before rank 0 bound it


def gather(refs: Sequence[Any], timeout: float | None = None) -> list[Any]:
    """Results of ``refs`` in order, failing as soon as any one fails (``skyrl_core.backends.ray_actors``)."""
    return ray_actors.gather(refs, timeout, what="Megatron ranks")
