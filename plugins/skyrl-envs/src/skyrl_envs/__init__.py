"""skyrl-envs: environments: arithmetic, math, SQL, search, code, multi-tool."""

__version__ = "0.1.0"
