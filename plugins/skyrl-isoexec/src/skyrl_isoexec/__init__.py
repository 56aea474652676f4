"""skyrl-isoexec: IsoExec: bitwise-identical logprobs between trainer and engine."""

__version__ = "0.1.0"
