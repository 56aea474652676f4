"""``engine.placement: separate``: N engine replicas in their own processes behind one engine.

``EngineRouter`` is what the RL loop holds in place of an in-process engine. Each request goes to
the replica with the fewest samples in flight, except that every request of an episode group (the
part of ``request_id`` before ``/``: a row's first turn and each of its episodes' later turns) goes
to the replica its first turn went to, whose cache holds its prefix. The sub-batches of one
``generate`` call run on their replicas at once. Weights go to every replica: ``broadcast`` over a
gloo pair per replica, or ``checkpoint``: one file written, loaded by each.
"""

from __future__ import annotations

import collections
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Iterable, Sequence

from skyrl_core import weight_sync
from skyrl_core.engine_actor import RemoteEngine

AFFINITY_ENTRIES = 65536  # episode groups remembered (oldest forgotten first)


def episode_key(request_id: str) -> str:
    return request_id.split("/", 1)[0]


class EngineRouter:
    """Replicas behind the ``InferenceEngine`` calls."""

    def __init__(self, replicas: Sequence[RemoteEngine], *, method: str, checkpoint_dir: str | None = None) -> None:
        self.replicas = list(replicas)
        self.method, self.checkpoint_dir = method, checkpoint_dir
        self.supports_pause = all(r.supports_pause for r in self.replicas)
        self.supports_kv_recompute = all(getattr(r, "supports_kv_recompute", False) for r in self.replicas)
        self.load = [0] * len(self.replicas)  # samples in flight per replica
        self._affinity: collections.OrderedDict[str, int] = collections.OrderedDict()
        self._lock = threading.Lock()
        self._pool = ThreadPoolExecutor(max_workers=max(1, len(self.replicas)), thread_name_prefix="skyrl-router")

    def route(self, requests: Sequence[Any]) -> list[int]:
        """The replica of each request (and count its samples in flight there)."""
        chosen = []
        with self._lock:
            for req in requests:
                key = episode_key(req.request_id)
                replica = self._affinity.get(key)
                if replica is None:
                    replica = min(range(len(self.replicas)), key=lambda i: (self.load[i], i))
                    self._affinity[key] = replica
                    if len(self._affinity) > AFFINITY_ENTRIES:
                        self._affinity.popitem(last=False)
                self.load[replica] += req.sampling.n
                chosen.append(replica)
        return chosen

    def generate(self, requests: Sequence[Any]) -> list[list[Any]]:
        chosen = self.route(requests)
        parts: dict[int, list[int]] = {}
        for i, replica in enumerate(chosen):
            parts.setdefault(replica, []).append(i)
        try:
            futures = {r: self._pool.submit(self.replicas[r].generate, [requests[i] for i in idx])
                       for r, idx in parts.items()}
            out: list[Any] = [None] * len(requests)
            for r, idx in parts.items():
                for i, samples in zip(idx, futures[r].result()):
                    out[i] = samples
            return out
        finally:
            with self._lock:
                for req, replica in zip(requests, chosen):
                    self.load[replica] -= req.sampling.n

    def update_weights(self, named_tensors: Iterable[Any], version: int | None = None) -> None:
        tensors = [(n, t.detach().to("cpu").clone()) for n, t in named_tensors]
        if self.method == "checkpoint":
            path = weight_sync.write_checkpoint(self.checkpoint_dir, tensors, version or 0)
            for r in self.replicas:
                r.load_checkpoint(path, version)
                r.remember(tensors, version)
            for name in os.listdir(self.checkpoint_dir):  # only the newest file is kept
                if os.path.join(self.checkpoint_dir, name) != path:
                    os.remove(os.path.join(self.checkpoint_dir, name))
        else:
            for r in self.replicas:
                r.receive_broadcast(tensors, version)
                r.remember(tensors, version)

    def pause(self) -> None:
        self._each("pause")

    def resume(self) -> None:
        self._each("resume")

    def recompute_kv(self) -> None:
        self._each("recompute_kv")

    def execution_contract(self) -> dict[str, Any]:
        """The first replica's (the handshake checks each replica's own: ``replicas``; their op-call
        counts differ with the requests each served)."""
        return self.replicas[0].execution_contract()

    def sleep(self) -> None:
        self._each("sleep")

    def wake(self) -> None:
        self._each("wake")

    def _each(self, method: str) -> None:
        for r in self.replicas:
            getattr(r, method)()

    @property
    def restarts(self) -> int:
        return sum(r.restarts for r in self.replicas)

    def close(self) -> None:
        self._pool.shutdown(wait=False)
        for r in self.replicas:
            r.close()


def start_separate_engines(cfg: Any, model: Any, *, placement: Any, run_dir: str) -> EngineRouter:
    """``cfg.engine.replicas`` engine processes in ``placement``'s engine bundle, behind a router."""
    ec = cfg.engine
    method = "broadcast" if ec.weight_sync == "auto" else ec.weight_sync
    checkpoint_dir = os.path.join(run_dir, "engine_weights")
    replicas: list[RemoteEngine] = []
    try:
        for i in range(ec.replicas):
            replicas.append(RemoteEngine(
                ec, model, seed=cfg.trainer.seed, name=f"engine-{i}", checkpoint_dir=checkpoint_dir,
                actor_options=placement.engine_options(), method=method, restart_on_failure=ec.restart_on_failure))
    except BaseException:
        for r in replicas:
            r.close()
        raise
    return EngineRouter(replicas, method=method, checkpoint_dir=checkpoint_dir)
