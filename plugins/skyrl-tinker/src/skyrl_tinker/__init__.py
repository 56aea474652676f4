"""skyrl-tinker: a Tinker API server (``skyrl tinker serve``) over a base model with LoRA adapters.

Light to import: the server, torch and the SDK's types load when ``serve`` runs.
"""

__version__ = "0.1.0"
