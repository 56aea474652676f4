"""Where a run's Ray actors go (``engine.placement: separate``): one Ray placement group with a
bundle for the trainer ranks and one for the engine replicas.

- ``colocate``: ``STRICT_PACK``, both bundles on one node;
- ``disaggregate``: ``STRICT_SPREAD``, the trainer ranks' bundle on one node, the engines' on another.

The bundles reserve ``engine.trainer_bundle`` and ``engine.engine_bundle`` (x replicas); a custom
resource there pins a bundle to the nodes that offer it. Actors themselves reserve nothing more
(``num_cpus=0``): a bundle says where they run, threads decide how many cores they use.

A backend that runs its ranks as Ray actors asks ``trainer_actor_options()`` while a placement is
active (the FSDP backend does); the run checks afterwards that it did, so ``disaggregate`` never
claims a placement that did not happen.
"""

from __future__ import annotations

from typing import Any

READY_TIMEOUT_S = 60.0
_active: "RayPlacement | None" = None


class RayPlacement:
    """The placement group of one run; ``close()`` removes it."""

    def __init__(self, strategy: str, trainer_bundle: dict[str, float], engine_bundle: dict[str, float],
                 replicas: int) -> None:
        import ray
        from ray.util.placement_group import placement_group

        if strategy not in ("colocate", "disaggregate"):
            raise ValueError(f"engine.ray_placement={strategy!r}: allowed are colocate, disaggregate")
        self.strategy = strategy
        engines = {k: v * replicas for k, v in engine_bundle.items()}
        self.bundles = [dict(trainer_bundle), engines]
        self.group = placement_group(self.bundles, strategy="STRICT_PACK" if strategy == "colocate" else "STRICT_SPREAD")
        self.trainer_placed = False
        try:
            ray.get(self.group.ready(), timeout=READY_TIMEOUT_S)
        except Exception as exc:
            self.close()
            raise RuntimeError(
                f"engine.ray_placement={strategy!r}: Ray could not place the bundles {self.bundles} "
                f"({'one node for both' if strategy == 'colocate' else 'two different nodes'}) within "
                f"{READY_TIMEOUT_S:.0f} s; cluster resources: {ray.cluster_resources()} ({type(exc).__name__})"
            ) from exc

    def _options(self, bundle: int) -> dict[str, Any]:
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        return {"scheduling_strategy": PlacementGroupSchedulingStrategy(
            placement_group=self.group, placement_group_bundle_index=bundle)}

    def trainer_options(self) -> dict[str, Any]:
        self.trainer_placed = True
        return self._options(0)

    def engine_options(self) -> dict[str, Any]:
        return self._options(1)

    def close(self) -> None:
        from ray.util.placement_group import remove_placement_group

        global _active
        if _active is self:
            _active = None
        try:
            remove_placement_group(self.group)
        except Exception:
            pass


def trainer_actor_options() -> dict[str, Any] | None:
    """Ray options for a trainer rank actor under the active placement (None: no placement)."""
    return _active.trainer_options() if _active is not None else None


def start_placement(engine: Any) -> RayPlacement | None:
    """The run's placement group for ``engine.placement: separate`` (None when colocated), active
    until closed."""
    global _active
    if engine.placement != "separate":
        return None
    from skyrl_core.local_ray import ensure_local_ray

    ensure_local_ray(2)
    _active = RayPlacement(engine.ray_placement, engine.trainer_bundle, engine.engine_bundle, engine.replicas)
    return _active
