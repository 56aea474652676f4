"""skyrl-sglang's registration. Imports nothing heavy: SGLang loads only when the engine is built."""

from __future__ import annotations

from skyrl_core.plugins import hookimpl
from skyrl_core.plugins.records import InferenceEngineSpec


@hookimpl
def skyrl_register_inference_engines(register) -> None:
    register(
        InferenceEngineSpec(
            name="sglang",
            factory="skyrl_sglang.engine:SGLangEngine",
            options="skyrl_sglang.options:SGLangOptions",
            preflight="skyrl_sglang.preflight:problems",
            description="SGLang's offline engine (CUDA GPUs only); in-place weight updates, memory release",
        )
    )
