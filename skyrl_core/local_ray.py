"""One way to start Ray for skyrl's own actors: a local session bound to loopback, no dashboard."""

from __future__ import annotations

import os

RAY_ENV_VARS = {"RAY_AUTH_MODE": "disabled", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}


def ensure_local_ray(num_cpus: int) -> None:
    """Join the running Ray session, or start a single-node local one (no dashboard).

    Ray advertises this machine's own interface address even when asked for 127.0.0.1
    (``services.resolve_ip_for_localhost``); all traffic stays on this machine.
    """
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")  # Ray 2.60 otherwise writes a token to ~/.ray
    import ray

    if ray.is_initialized():
        return
    ray.init(
        address="local",
        include_dashboard=False,
        num_cpus=max(num_cpus, os.cpu_count() or 1),
        runtime_env={"env_vars": dict(RAY_ENV_VARS)},
    )


def skyrl_environment() -> dict[str, str]:
    """This process's ``SKYRL_*`` environment variables (plugin switches such as ``SKYRL_ISOEXEC``)."""
    return {k: v for k, v in os.environ.items() if k.startswith("SKYRL_")}


def adopt_skyrl_environment(environ: dict[str, str]) -> None:
    """Make this process's ``SKYRL_*`` variables exactly ``environ`` (the driver's).

    A Ray worker inherits the environment of the Ray session, i.e. of the process that started Ray,
    not the driver's present state: a plugin switched on or off since (IsoExec on for one verify
    run, off for the next) would otherwise decide differently in the ranks than in the driver.
    Every rank actor calls this first with the ``skyrl_environment()`` its driver sent.
    """
    for key in [k for k in os.environ if k.startswith("SKYRL_") and k not in environ]:
        del os.environ[key]
    os.environ.update(environ)
