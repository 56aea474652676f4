"""N ``FSDPRank``s as Ray actors on this machine: starting them, calling them together, stopping them.

Each rank lives in a ``RankHost`` actor (a worker process that hosts one rank at a time). With
``FSDPOptions.reuse_workers`` a closed backend leaves its hosts idle in this Ray session and the next
backend reuses them, skipping a process start and the torch/transformers import (seconds per rank).
"""

from __future__ import annotations

import gc
import os
from typing import Any, Sequence

os.environ.setdefault("RAY_AUTH_MODE", "disabled")

import attrs  # noqa: E402
import ray  # noqa: E402

from skyrl_core.backends import ray_actors  # noqa: E402
from skyrl_core.backends.ray_actors import kill  # noqa: E402
from skyrl_core.ports import on_a_free_port  # noqa: E402
from skyrl_core.local_ray import adopt_skyrl_environment, ensure_local_ray, skyrl_environment  # noqa: E402
from skyrl_core.ray_placement import trainer_actor_options  # noqa: E402

READY_TIMEOUT_S = 300

# Idle hosts per (Ray node id of this session, uses a GPU): a new Ray session never sees old ones.
_idle_hosts: dict[tuple[str, bool], list[Any]] = {}
_placed_hosts: set[str] = set()  # actor ids of hosts placed in a run's placement group


def ensure_ray(num_cpus: int) -> None:
    """Use the running Ray session, or start a local one on loopback (see skyrl_core.local_ray)."""
    ensure_local_ray(num_cpus)


class RankHost:
    """A worker process hosting one ``FSDPRank`` at a time."""

    def __init__(self) -> None:
        self.rank: Any = None

    def start(self, environ: dict[str, str], *args: Any, **kwargs: Any) -> int:
        adopt_skyrl_environment(environ)  # the driver's plugin switches now, not the Ray session's
        from skyrl_fsdp.rank import FSDPRank

        self.rank = FSDPRank(*args, **kwargs)
        return self.rank.rank

    def call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        return getattr(self.rank, method)(*args, **kwargs)

    def node_id(self) -> str:
        """The Ray node this host runs on (where a placement group put it)."""
        return ray.get_runtime_context().get_node_id()

    def stop(self) -> None:
        if self.rank is not None:
            self.rank.close()
            self.rank = None
            gc.collect()


_RemoteRankHost = ray.remote(num_cpus=0)(RankHost)


def _pool_key(use_gpu: bool) -> tuple[str, bool]:
    return ray.get_runtime_context().get_node_id(), use_gpu


def start_ranks(model: Any, options: Any, trainer: Any, *, seed: int, use_gpu: bool) -> list[Any]:
    """``options.world_size`` hosts, each running one rank; the ranks rendezvous over TCP on
    loopback. Returns when every rank is built."""
    world_size = options.world_size
    ensure_ray(world_size)
    if options.threads_per_rank is None:  # share this machine's cores between the ranks
        options = attrs.evolve(options, threads_per_rank=max(1, (os.cpu_count() or 1) // world_size))
    # engine.placement=separate: the run's placement group says where the ranks go (fresh hosts there)
    placed = trainer_actor_options()
    idle = _idle_hosts.setdefault(_pool_key(use_gpu), []) if options.reuse_workers and placed is None else []
    # Hosts reserve no logical CPU: a run holds several backends at once (policy, reference) and
    # threads_per_rank, not Ray's bookkeeping, decides how many cores a rank uses.
    host_class = _RemoteRankHost.options(num_gpus=1 if use_gpu else 0, **(placed or {}))

    def start_on(port: int) -> list[Any]:
        hosts = [idle.pop() if idle else host_class.remote() for _ in range(world_size)]
        if placed is not None:  # they go with their placement group: never reused after it
            _placed_hosts.update(host._actor_id.hex() for host in hosts)
        init_method = f"tcp://127.0.0.1:{port}"
        try:
            gather(
                [
                    host.start.remote(skyrl_environment(), model, options, trainer, seed=seed, rank=rank, world_size=world_size, init_method=init_method)
                    for rank, host in enumerate(hosts)
                ],
                timeout=READY_TIMEOUT_S,
            )
        except BaseException:
            kill(hosts)
            raise
        return hosts

    return on_a_free_port(start_on)  # again on another port if one was taken before rank 0 bound it


def stop_ranks(hosts: Sequence[Any], *, reuse: bool, use_gpu: bool) -> None:
    """Stop the ranks; keep the hosts for reuse in this Ray session, or kill them."""
    if reuse and ray.is_initialized() and not any(host._actor_id.hex() in _placed_hosts for host in hosts):
        try:
            gather([host.stop.remote() for host in hosts], timeout=60)
        except Exception:
            kill(hosts)
            return
        _idle_hosts.setdefault(_pool_key(use_gpu), []).extend(hosts)
    else:
        kill(hosts)


def call_ranks(hosts: Sequence[Any], method: str, per_rank_args: Sequence[tuple], **kwargs: Any) -> list[Any]:
    return gather([host.call.remote(method, *args, **kwargs) for host, args in zip(hosts, per_rank_args)])


def gather(refs: Sequence[Any], timeout: float | None = None) -> list[Any]:
    """Results of ``refs`` in order, failing as soon as any one fails (``skyrl_core.backends.ray_actors``)."""
    return ray_actors.gather(refs, timeout, what="FSDP ranks")
