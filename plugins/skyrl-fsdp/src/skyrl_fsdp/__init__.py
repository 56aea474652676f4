"""skyrl-fsdp: FSDP2 training backend (gloo on CPU, nccl on GPU)."""

__version__ = "0.1.0"
