"""An inference engine in its own process (a Ray actor), and the trainer-side handle to it.

``RemoteEngine`` speaks the ``InferenceEngine`` calls (``generate``, ``pause``, ``resume``,
``update_weights``, ...) to an ``EngineActor`` and syncs weights into it by ``broadcast`` (a gloo
pair, ``skyrl_core.weight_sync``) or through a ``checkpoint`` directory. A dead engine process is
reported at once, naming it (``EngineProcessError``), instead of a hang or a bare Ray error; with
``restart_on_failure`` a new process is started instead, given the last weights, and the call that
failed is made again. ``engine.placement: separate`` runs the run's engines this way
(``skyrl_core.engine_router``).
"""

from __future__ import annotations

import os
import threading
import time
import uuid
from typing import Any, Iterable, Sequence

from skyrl_core import weight_sync


class EngineProcessError(RuntimeError):
    """The engine's process died or cannot be reached."""


class EngineActor:
    """Runs inside the Ray actor: builds the engine the config selects, serves calls concurrently
    (``generate`` from several rollout threads, ``pause``/``update``/``resume`` meanwhile)."""

    def __init__(self, engine: Any, model: Any, seed: int, environ: dict[str, str]) -> None:
        from skyrl_core.local_ray import adopt_skyrl_environment
        from skyrl_core.plugins.manager import get_plugin_manager
        from skyrl_core.plugins.building import build_selected

        adopt_skyrl_environment(environ)
        self.engine = build_selected(get_plugin_manager(), "inference_engine", engine, model, seed=seed)
        self._group = None

    def pid(self) -> int:
        return os.getpid()

    def describe(self) -> dict[str, Any]:
        """What the trainer's handle needs to know: process, node, whether it pauses."""
        import ray

        return {"pid": os.getpid(), "node_id": ray.get_runtime_context().get_node_id(),
                "supports_pause": bool(getattr(self.engine, "supports_pause", False)),
                "supports_kv_recompute": bool(getattr(self.engine, "supports_kv_recompute", False))}

    def execution_contract(self) -> dict[str, Any]:
        return self.engine.execution_contract()

    def sleep(self) -> None:
        self.engine.sleep()

    def wake(self) -> None:
        self.engine.wake()

    def generate(self, requests: Sequence[Any]) -> list[list[Any]]:
        return self.engine.generate(requests)

    def pause(self) -> None:
        self.engine.pause()

    def resume(self) -> None:
        self.engine.resume()

    def recompute_kv(self) -> None:
        self.engine.recompute_kv()

    def update_from_checkpoint(self, path: str, version: int | None) -> None:
        self._update(weight_sync.read_checkpoint(path), version)

    def join_broadcast(self, host: str, port: int) -> None:
        self._group = weight_sync.join_gloo_pair(host, port)

    def update_from_broadcast(self, manifest: weight_sync.Manifest, version: int | None) -> None:
        # receive everything first: a half-received update must not reach the engine
        tensors = list(weight_sync.receive_by_broadcast(self._group, manifest))
        self._update(tensors, version)

    def weights_digest(self) -> str:
        own = getattr(self.engine, "weights_digest", None)  # an engine whose weights live elsewhere (vLLM's worker)
        if own is not None:
            return own()
        return weight_sync.weights_digest(self.engine.model.state_dict().items())

    def close(self) -> None:
        self.engine.close()

    def _update(self, tensors: Iterable[Any], version: int | None) -> None:
        if getattr(self.engine, "supports_pause", False):
            self.engine.update_weights(tensors, version=version)
        else:
            self.engine.update_weights(tensors)


class RemoteEngine:
    """The trainer's handle to an ``EngineActor`` (``name`` appears in every error about it).

    ``actor_options``: Ray options of the actor (a placement-group scheduling strategy).
    ``method``: how ``update_weights`` moves weights, ``broadcast`` or ``checkpoint``."""

    def __init__(self, engine: Any, model: Any, *, seed: int, name: str = "engine-0",
                 resources: dict[str, float] | None = None, checkpoint_dir: str | None = None,
                 actor_options: dict[str, Any] | None = None, method: str = "broadcast",
                 restart_on_failure: bool = False) -> None:
        if method not in ("broadcast", "checkpoint"):
            raise ValueError(f"weight sync method {method!r}: allowed are broadcast, checkpoint")
        self.name = name
        self.checkpoint_dir = checkpoint_dir
        self.method = method
        self.restart_on_failure = restart_on_failure
        self.restarts = 0
        self._spec = (engine, model, seed, dict(resources or {}), dict(actor_options or {}))
        self._last: tuple[list[Any], int | None] | None = None  # the weights to give a restarted process
        self._version = 0
        self._restarting, self._sending = threading.Lock(), threading.Lock()
        self._start()

    def _start(self) -> None:
        import ray

        from skyrl_core.local_ray import skyrl_environment

        engine, model, seed, resources, actor_options = self._spec
        actor_class = ray.remote(num_cpus=0, max_concurrency=16, resources=resources)(EngineActor)
        # a Ray name (skyrl-engine-0-<random>) lets tools find the process of a replica
        self.actor = actor_class.options(name=f"skyrl-{self.name}-{uuid.uuid4().hex[:8]}", **actor_options).remote(
            engine, model, seed, skyrl_environment())
        self._group = None
        self.pid = None
        info = self._wait(self.actor.describe.remote(), "start")
        self.pid, self.node_id, self.supports_pause = info["pid"], info["node_id"], info["supports_pause"]
        self.supports_kv_recompute = info["supports_kv_recompute"]

    # -- InferenceEngine calls -------------------------------------------------------------------

    def generate(self, requests: Sequence[Any]) -> list[list[Any]]:
        return self._call("generate", list(requests))

    def pause(self) -> None:
        self._call("pause")

    def resume(self) -> None:
        self._call("resume")

    def recompute_kv(self) -> None:
        self._call("recompute_kv")

    def execution_contract(self) -> dict[str, Any]:
        return self._call("execution_contract")

    def sleep(self) -> None:
        self._call("sleep")

    def wake(self) -> None:
        self._call("wake")

    def update_weights(self, named_tensors: Iterable[Any], version: int | None = None, *, method: str | None = None) -> float:
        """Send the weights by ``method`` (default: this engine's); returns the seconds it took."""
        method = method or self.method
        started = time.perf_counter()
        tensors = [(n, t.detach().to("cpu").clone()) for n, t in named_tensors]
        if method == "checkpoint":
            if self.checkpoint_dir is None:
                raise ValueError(f"{self.name}: weight sync by checkpoint needs a checkpoint directory")
            self._version = self._version + 1 if version is None else version
            path = weight_sync.write_checkpoint(self.checkpoint_dir, tensors, self._version)
            self.load_checkpoint(path, version)
        elif method == "broadcast":
            self.receive_broadcast(tensors, version)
        else:
            raise ValueError(f"weight sync method {method!r}: allowed are broadcast, checkpoint")
        self.remember(tensors, version)
        return time.perf_counter() - started

    def load_checkpoint(self, path: str, version: int | None) -> None:
        """Load a weights file the trainer wrote (shared by every replica of a router)."""
        self._call("update_from_checkpoint", path, version)

    def receive_broadcast(self, tensors: list[Any], version: int | None) -> None:
        """Broadcast ``tensors`` from this process (rank 0 of the pair) into the engine's."""
        self._retrying("update_from_broadcast", lambda: self._send_broadcast(tensors, version))

    def _send_broadcast(self, tensors: list[Any], version: int | None) -> None:
        with self._sending:  # one update at a time over the pair (a restart may send beside the trainer)
            group = self._broadcast_group()
            pending = self.actor.update_from_broadcast.remote(weight_sync.manifest_of(tensors), version)
            weight_sync.send_by_broadcast(group, tensors)
            self._wait(pending, "update_from_broadcast")

    def remember(self, tensors: list[Any], version: int | None) -> None:
        if self.restart_on_failure:
            self._last = (tensors, version)

    def weights_digest(self) -> str:
        return self._call("weights_digest")

    def close(self) -> None:
        import ray

        try:
            ray.kill(self.actor)
        except Exception:
            pass

    # -- helpers -----------------------------------------------------------------------------------

    def _broadcast_group(self) -> Any:
        if self._group is None:
            host = weight_sync.GlooPairHost("127.0.0.1")
            joining = self.actor.join_broadcast.remote("127.0.0.1", host.port)
            self._group = host.group()
            self._wait(joining, "join_broadcast")
        return self._group

    def _call(self, method: str, *args: Any) -> Any:
        return self._retrying(method, lambda: self._wait(getattr(self.actor, method).remote(*args), method))

    def _retrying(self, method: str, call: Any) -> Any:
        """``call()``; if the process died and ``restart_on_failure``: restart it and call once more.
        (Calls from several threads may see one death: the first restarts, the others retry.)"""
        actor = self.actor
        try:
            return call()
        except EngineProcessError:
            if not self.restart_on_failure:
                raise
            with self._restarting:
                if self.actor is actor:
                    self.restart(f"died during {method}")
            return call()

    def restart(self, why: str) -> None:
        """A new engine process in place of the dead one, holding the last weights sent."""
        import warnings

        old_pid = self.pid
        self.close()
        self._start()
        self.restarts += 1
        warnings.warn(f"engine process {self.name!r} (pid {old_pid}) {why}; restarted as pid {self.pid}", stacklevel=2)
        if self._last is not None:
            self._send_broadcast(*self._last)

    def _wait(self, ref: Any, method: str) -> Any:
        import ray
        from ray.exceptions import ActorDiedError, ActorUnavailableError, RayActorError

        try:
            return ray.get(ref)
        except (RayActorError, ActorDiedError, ActorUnavailableError) as exc:
            raise EngineProcessError(
                f"engine process {self.name!r} (pid {self.pid}) died or is unreachable during {method}: "
                f"{type(exc).__name__}"
            ) from exc
