"""Calling a backend's rank actors together, and killing them: results in rank order, failing fast.

Ranks of one backend meet in collectives, so a rank that fails leaves the others blocked waiting
for it: these helpers raise the first failure at once instead of waiting for every rank.
"""

from __future__ import annotations

from typing import Any, Sequence


def gather(refs: Sequence[Any], timeout: float | None = None, *, what: str = "ranks") -> list[Any]:
    """Results of ``refs`` in order. Fails as soon as any one fails: the other ranks may be blocked
    in a collective waiting for it, so waiting for all of them could hang. ``what`` names the
    ranks in the timeout message ("FSDP ranks")."""
    import ray

    pending = list(refs)
    while pending:
        done, pending = ray.wait(pending, num_returns=1, timeout=timeout)
        if not done:
            raise TimeoutError(
                f"{what} did not answer within {timeout} s; Ray resources available: "
                f"{ray.available_resources()} of {ray.cluster_resources()}"
            )
        ray.get(done[0])  # raises the rank's error
    return ray.get(list(refs))


def kill(actors: Sequence[Any]) -> None:
    """Kill every actor; one that already died is fine."""
    import ray

    for actor in actors:
        try:
            ray.kill(actor)
        except Exception:
            pass
