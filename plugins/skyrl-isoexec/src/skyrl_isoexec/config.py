"""The ``isoexec:`` config section (light: no torch)."""

from __future__ import annotations

import attrs


def _bool(instance, attribute, value):
    if not isinstance(value, bool):
        raise ValueError(f"isoexec.{attribute.name} must be true or false, got {value!r}")


@attrs.frozen(kw_only=True)
class IsoExecConfig:
    """IsoExec: trainer and engine compute bitwise-identical token logprobs."""

    enabled: bool = attrs.field(
        default=False, validator=_bool,
        metadata={"help": "install the canonical ops in the trainer and the engine (also: SKYRL_ISOEXEC=1)"},
    )
    skip_old_logprob_pass: bool = attrs.field(
        default=True, validator=_bool,
        metadata={"help": "with a verified contract, use the rollout logprobs as old logprobs (no extra forward)"},
    )
    check_fingerprint: bool = attrs.field(
        default=True, validator=_bool,
        metadata={"help": "refuse a weight sync when an op ran with another implementation than declared"},
    )
