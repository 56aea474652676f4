"""An inference engine in its own process (a Ray actor), and the trainer-side handle to it.

``RemoteEngine`` speaks the ``InferenceEngine`` calls (``generate``, ``pause``, ``resume``) to an
``EngineActor`` and syncs weights into it by ``broadcast`` (a gloo pair, ``skyrl_core.weight_sync``)
or through a ``checkpoint`` directory. A dead engine process is reported at once, naming it
(``EngineProcessError``), instead of a hang or a bare Ray error.

Not wired into the RL loop yet: ``engine.placement: separate`` is not a config value (see
docs/training.md); this is the engine-process building block and its weight-sync paths.
"""

from __future__ import annotations

import os
import time
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
        from skyrl_core.trainer.runtime import build_selected

        adopt_skyrl_environment(environ)
        self.engine = build_selected(get_plugin_manager(), "inference_engine", engine, model, seed=seed)
        self._group = None

    def pid(self) -> int:
        return os.getpid()

    def generate(self, requests: Sequence[Any]) -> list[list[Any]]:
        return self.engine.generate(requests)

    def pause(self) -> None:
        self.engine.pause()

    def resume(self) -> None:
        self.engine.resume()

    def update_from_checkpoint(self, path: str, version: int | None) -> None:
        self._update(weight_sync.read_checkpoint(path), version)

    def join_broadcast(self, host: str, port: int) -> None:
        self._group = weight_sync.gloo_pair(host, port, rank=1)

    def update_from_broadcast(self, manifest: weight_sync.Manifest, version: int | None) -> None:
        # receive everything first: a half-received update must not reach the engine
        tensors = list(weight_sync.receive_by_broadcast(self._group, manifest))
        self._update(tensors, version)

    def weights_digest(self) -> str:
        return weight_sync.weights_digest(self.engine.model.state_dict().items())

    def close(self) -> None:
        self.engine.close()

    def _update(self, tensors: Iterable[Any], version: int | None) -> None:
        if getattr(self.engine, "supports_pause", False):
            self.engine.update_weights(tensors, version=version)
        else:
            self.engine.update_weights(tensors)


class RemoteEngine:
    """The trainer's handle to an ``EngineActor`` (``name`` appears in every error about it)."""

    def __init__(self, engine: Any, model: Any, *, seed: int, name: str = "engine-0",
                 resources: dict[str, float] | None = None, checkpoint_dir: str | None = None) -> None:
        import ray

        from skyrl_core.local_ray import skyrl_environment

        self.name = name
        self.checkpoint_dir = checkpoint_dir
        self.supports_pause = True
        actor_class = ray.remote(num_cpus=0, max_concurrency=16, resources=resources or {})(EngineActor)
        self.actor = actor_class.remote(engine, model, seed, skyrl_environment())
        self.pid = self._call("pid")
        self._group = None
        self._version = 0

    # -- InferenceEngine calls -------------------------------------------------------------------

    def generate(self, requests: Sequence[Any]) -> list[list[Any]]:
        return self._call("generate", list(requests))

    def pause(self) -> None:
        self._call("pause")

    def resume(self) -> None:
        self._call("resume")

    def update_weights(self, named_tensors: Iterable[Any], version: int | None = None, *, method: str = "broadcast") -> float:
        """Send the weights by ``broadcast`` or ``checkpoint``; returns the seconds it took."""
        started = time.perf_counter()
        tensors = [(n, t.detach().to("cpu").clone()) for n, t in named_tensors]
        if method == "checkpoint":
            if self.checkpoint_dir is None:
                raise ValueError(f"{self.name}: weight sync by checkpoint needs a checkpoint directory")
            self._version = self._version + 1 if version is None else version
            path = weight_sync.write_checkpoint(self.checkpoint_dir, tensors, self._version)
            self._call("update_from_checkpoint", path, version)
        elif method == "broadcast":
            group = self._broadcast_group()
            pending = self.actor.update_from_broadcast.remote(weight_sync.manifest_of(tensors), version)
            weight_sync.send_by_broadcast(group, tensors)
            self._wait(pending, "update_from_broadcast")
        else:
            raise ValueError(f"weight sync method {method!r}: allowed are broadcast, checkpoint")
        return time.perf_counter() - started

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
            from skyrl_core.backends.ray_actors import free_port

            port = free_port()
            joining = self.actor.join_broadcast.remote("127.0.0.1", port)
            self._group = weight_sync.gloo_pair("127.0.0.1", port, rank=0)
            self._wait(joining, "join_broadcast")
        return self._group

    def _call(self, method: str, *args: Any) -> Any:
        return self._wait(getattr(self.actor, method).remote(*args), method)

    def _wait(self, ref: Any, method: str) -> Any:
        import ray
        from ray.exceptions import ActorDiedError, ActorUnavailableError, RayActorError

        try:
            return ray.get(ref)
        except (RayActorError, ActorDiedError, ActorUnavailableError) as exc:
            pid = getattr(self, "pid", None)
            raise EngineProcessError(
                f"engine process {self.name!r} (pid {pid}) died or is unreachable during {method}: "
                f"{type(exc).__name__}"
            ) from exc
