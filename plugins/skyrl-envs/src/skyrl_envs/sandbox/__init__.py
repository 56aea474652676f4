"""A subprocess sandbox for model-written Python (namespaces, rlimits, private tmpfs, no network)."""

from skyrl_envs.sandbox.limits import SandboxLimits
from skyrl_envs.sandbox.runner import SandboxResult, SandboxUnavailable, run_python

__all__ = ["SandboxLimits", "SandboxResult", "SandboxUnavailable", "run_python"]
