"""skyrl-sglang: SGLang inference engine."""

__version__ = "0.1.0"
