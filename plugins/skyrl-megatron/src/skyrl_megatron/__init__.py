"""skyrl-megatron: Megatron-core training backend."""

__version__ = "0.1.0"
