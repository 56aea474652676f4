"""Pausing an inference engine mid-generation (``InferenceEngine.pause``/``resume``), for engines
that cannot: they refuse plainly, so a run that needs in-flight weight updates (``trainer.mode:
fully_async``) is refused at its start instead of silently waiting for whole batches."""

from __future__ import annotations


class PauseNotSupported:
    """Mixin: ``supports_pause = False`` and ``pause``/``resume``/``recompute_kv`` raising ``NotImplementedError``."""

    supports_pause = False
    supports_kv_recompute = False

    def pause(self) -> None:
        raise NotImplementedError(
            f"{type(self).__name__} cannot pause in-flight requests (pause/resume with in-place weight "
            "updates is built for the torch and vllm engines)"
        )

    def resume(self) -> None:
        self.pause()

    def recompute_kv(self) -> None:
        self.pause()
