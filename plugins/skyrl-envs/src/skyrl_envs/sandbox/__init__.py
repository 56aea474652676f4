"""A subprocess sandbox for model-written Python (namespaces, a minimal read-only root, cgroups, seccomp, rlimits, no network)."""

from skyrl_envs.sandbox.limits import SandboxLimits
from skyrl_envs.sandbox.runner import SandboxResult, SandboxUnavailable, run_python

__all__ = ["SandboxLimits", "SandboxResult", "SandboxUnavailable", "run_python"]
