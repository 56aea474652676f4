"""skyrl-vllm: vLLM inference engine and OpenAI-compatible engine."""

__version__ = "0.1.0"
