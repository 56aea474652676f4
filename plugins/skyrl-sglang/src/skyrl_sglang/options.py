"""Options of the ``sglang`` engine (``engine: {name: sglang, options: {...}}``). No heavy imports."""

from __future__ import annotations

from typing import Any

import attrs

from skyrl_core.config.validators import one_of, optional_positive_int

DTYPES = ("float32", "bfloat16", "float16")


def _help(text: str) -> dict[str, Any]:
    return {"help": text}


@attrs.frozen(kw_only=True)
class SGLangOptions:
    """How ``sglang.Engine`` is started. ``None`` means SGLang's own default."""

    dtype: str | None = attrs.field(
        default=None, validator=one_of(*DTYPES, optional=True),
        metadata=_help("weights/activations dtype (default: model.dtype)"),
    )
    mem_fraction_static: float = attrs.field(
        default=0.5, metadata=_help("fraction of GPU memory for weights + KV cache (the rest is the trainer's)")
    )
    context_length: int | None = attrs.field(
        default=None, validator=optional_positive_int, metadata=_help("longest prompt + response (null: the model's)")
    )
    max_running_requests: int | None = attrs.field(
        default=None, validator=optional_positive_int, metadata=_help("sequences decoded together")
    )
    deterministic: bool = attrs.field(
        default=True,
        metadata=_help(
            "SGLang's enable_deterministic_inference: batch-invariant kernels, and per-request seeds are honoured"
        ),
    )
    enable_memory_saver: bool = attrs.field(
        default=True, metadata=_help("needed by sleep()/wake() (release/resume memory occupation)")
    )
    sleep_tags: tuple[str, ...] = attrs.field(
        default=("kv_cache",),
        converter=tuple,
        metadata=_help(
            "what sleep() releases: kv_cache, weights, cuda_graph (after releasing weights, update_weights "
            "before generating again)"
        ),
    )
    engine_kwargs: dict[str, Any] = attrs.field(factory=dict, metadata=_help("extra keyword arguments for sglang.Engine"))

    def __attrs_post_init__(self) -> None:
        if not 0.0 < self.mem_fraction_static < 1.0:
            raise ValueError(f"mem_fraction_static must be in (0, 1), got {self.mem_fraction_static!r}")
        if not isinstance(self.engine_kwargs, dict) or not all(isinstance(k, str) for k in self.engine_kwargs):
            raise ValueError(f"engine_kwargs must be a mapping of argument names to values, got {self.engine_kwargs!r}")
        unknown = sorted(set(self.sleep_tags) - {"kv_cache", "weights", "cuda_graph"})
        if unknown or not self.sleep_tags:
            raise ValueError(f"sleep_tags must be a non-empty subset of kv_cache, weights, cuda_graph; got {self.sleep_tags!r}")
        reserved = {"model_path", "tokenizer_path", "random_seed", "skip_tokenizer_init"}
        clash = sorted(reserved & set(self.engine_kwargs))
        if clash:
            raise ValueError(
                f"engine_kwargs may not set {', '.join(clash)}: the engine sets them itself "
                f"(reserved: {', '.join(sorted(reserved))})"
            )
