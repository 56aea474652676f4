"""The ``isoexec:`` config section (light: no torch).

Whether IsoExec is on follows one rule, in every process: an explicit ``isoexec.enabled`` in the
config, else the environment variable ``SKYRL_ISOEXEC`` (``1``/``true``/``yes``/``on``), else off.
The section's default is read from the variable when the config is built, so the resolved config
(``skyrl config show``, the run's ``config.yaml``) records the decision; the run then mirrors it into
the variable for the processes it starts (FSDP ranks, Ray actors, engine workers).
"""

from __future__ import annotations

import os

import attrs

ENV_VAR = "SKYRL_ISOEXEC"
_TRUE = {"1", "true", "yes", "on"}


def env_enabled() -> bool:
    """Whether ``SKYRL_ISOEXEC`` asks for IsoExec."""
    return os.environ.get(ENV_VAR, "").strip().lower() in _TRUE


def _bool(instance, attribute, value):
    if not isinstance(value, bool):
        raise ValueError(f"isoexec.{attribute.name} must be true or false, got {value!r}")


@attrs.frozen(kw_only=True)
class IsoExecConfig:
    """IsoExec: trainer and engine compute bitwise-identical token logprobs."""

    enabled: bool = attrs.field(
        factory=env_enabled, validator=_bool,
        metadata={"help": "install the canonical ops in the trainer and the engine (unset: SKYRL_ISOEXEC=1 turns it on)"},
    )
    skip_old_logprob_pass: bool = attrs.field(
        default=True, validator=_bool,
        metadata={"help": "with a verified contract, use the rollout logprobs as old logprobs (no extra forward)"},
    )
    check_fingerprint: bool = attrs.field(
        default=True, validator=_bool,
        metadata={"help": "refuse a weight sync when an op ran with another implementation than declared"},
    )
