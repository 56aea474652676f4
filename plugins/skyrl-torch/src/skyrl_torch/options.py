"""Options of the native engine (``engine: {name: torch, options: {...}}``). Light: no torch import."""

from __future__ import annotations

from typing import Any

import attrs

ATTENTION_KINDS = ("model", "sdpa", "eager")
IMPLEMENTATIONS = ("auto", "native", "transformers")
CPU_GEMMS = ("onednn", "torch")
DEVICES = ("cpu", "cuda")


def _positive_int(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{attribute.name} must be an integer >= 1; got {value!r}")


def _optional_positive_int(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
    if value is not None:
        _positive_int(instance, attribute, value)


def _non_negative_int(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{attribute.name} must be an integer >= 0; got {value!r}")


def _bool(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
    if not isinstance(value, bool):
        raise ValueError(f"{attribute.name} must be true or false; got {value!r}")


def _one_of(*allowed: str):
    def check(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
        if value not in allowed:
            raise ValueError(f"{attribute.name} must be one of {', '.join(allowed)}; got {value!r}")

    return check


@attrs.frozen(kw_only=True)
class TorchEngineOptions:
    """How the native engine batches and where it keeps its KV cache."""

    max_num_seqs: int = attrs.field(
        default=64,
        validator=_positive_int,
        metadata={"help": "KV-cache slots: samples decoded together; more samples wait and join as others finish"},
    )
    max_model_len: int | None = attrs.field(
        default=None,
        validator=_optional_positive_int,
        metadata={"help": "longest prompt + response in tokens (default: the model's max_position_embeddings)"},
    )
    shared_prefix_min_tokens: int = attrs.field(
        default=16,
        validator=_non_negative_int,
        metadata={
            "help": "prefill a prefix common to the prompts admitted together only once when it is at least "
            "this long (0: never)"
        },
    )
    implementation: str = attrs.field(
        default="auto",
        validator=_one_of(*IMPLEMENTATIONS),
        metadata={
            "help": "native: a lean forward for Llama/Mistral/Qwen2/Qwen3 over the model's weights (over an op "
            "plugin's ops, such as IsoExec's, when one installs them all); transformers: the model's own modules "
            "(any causal LM); auto: native when possible"
        },
    )
    cpu_gemm: str = attrs.field(
        default="onednn",
        validator=_one_of(*CPU_GEMMS),
        metadata={
            "help": "matrix products of the native implementation on CPU: onednn (fp32, often several times faster "
            "than torch's BLAS at decode batch sizes) or torch (F.linear); falls back to torch without oneDNN"
        },
    )
    prepack_weights: bool = attrs.field(
        default=True,
        validator=_bool,
        metadata={
            "help": "with cpu_gemm=onednn, the native implementation's fp32 GEMMs read copies of the weights "
            "reordered once into oneDNN's layout (same bits, 12-25% faster per decode-sized GEMM; renewed after "
            "each weight update; a second copy of the projection weights in memory): false saves that memory"
        },
    )
    attention: str = attrs.field(
        default="sdpa",
        validator=_one_of(*ATTENTION_KINDS),
        metadata={
            "help": "attention of the transformers implementation: sdpa, eager, or model (what the loaded model uses)"
        },
    )
    device: str = attrs.field(
        default="cpu", validator=_one_of(*DEVICES), metadata={"help": "where the model and KV cache live"}
    )
