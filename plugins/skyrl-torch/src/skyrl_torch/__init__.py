"""skyrl-torch: native pure-PyTorch inference engine (KV cache, continuous batching)."""

__version__ = "0.1.0"
