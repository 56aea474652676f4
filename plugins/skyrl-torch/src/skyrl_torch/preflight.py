"""What the ``torch`` engine's options need from the rest of the config, checked before a run."""

from __future__ import annotations

from typing import Any


def problems(config: Any, options: Any) -> list[str]:
    beside = getattr(options, "threads_beside_training", None)
    if beside is not None and config.engine.placement != "colocated":
        # The trainer says when it computes in its own process only; an engine process of its own
        # never hears it, so the option would never apply there.
        return [f"engine.options.threads_beside_training: {beside} needs engine.placement: colocated (an engine in "
                f"its own process does not share the trainer's threads; it has {config.engine.placement!r}); size "
                "that process with engine.options.threads instead"]
    return []
