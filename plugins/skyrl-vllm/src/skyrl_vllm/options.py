"""Options of the ``vllm`` and ``openai`` engines (``engine: {name: vllm, options: {...}}``).

Light module: no torch or vllm import, so configs validate on machines without them.
"""

from __future__ import annotations

from typing import Any

import attrs

from skyrl_core.config.validators import holds, nested, one_of, optional_positive_int

DTYPES = ("float32", "bfloat16", "float16")


def _help(text: str) -> dict[str, Any]:
    return {"help": text}


def _str_keyed_dict(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
    if not isinstance(value, dict) or not all(isinstance(k, str) for k in value):
        raise ValueError(f"{attribute.name} must be a mapping of argument names to values, got {value!r}")


def _sleep_level(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
    if value not in (1, 2):
        raise ValueError(f"sleep_level must be 1 (keep weights in host memory) or 2 (drop them), got {value!r}")


@attrs.frozen(kw_only=True)
class VLLMOptions:
    """How the vLLM engine is started. ``None`` means "decided from the model and the platform"."""

    dtype: str | None = attrs.field(
        default=None, validator=one_of(*DTYPES, optional=True), metadata=_help("weights/activations dtype (default: model.dtype)")
    )
    kv_cache_memory_bytes: int | None = attrs.field(
        default=128 << 20,
        validator=optional_positive_int,
        metadata=_help("bytes reserved for the KV cache (null: let vLLM size it from gpu_memory_utilization)"),
    )
    gpu_memory_utilization: float | None = attrs.field(
        default=None, metadata=_help("fraction of device memory vLLM may use when kv_cache_memory_bytes is null")
    )
    max_model_len: int | None = attrs.field(
        default=1024, validator=optional_positive_int, metadata=_help("longest prompt + response in tokens (null: the model's)")
    )
    max_num_seqs: int | None = attrs.field(
        default=None, validator=optional_positive_int, metadata=_help("sequences decoded together (null: vLLM's default)")
    )
    enforce_eager: bool | None = attrs.field(
        default=None, metadata=_help("skip torch.compile / CUDA graphs (null: true on CPU, false on GPU)")
    )
    enable_prefix_caching: bool | None = attrs.field(
        default=None, metadata=_help("reuse KV blocks of shared prompt prefixes (null: vLLM's default)")
    )
    multiprocess: bool = attrs.field(
        default=True,
        metadata=_help(
            "run vLLM's engine core and worker in their own processes; false runs everything in the "
            "calling process (faster start, but vLLM then changes that process's thread settings)"
        ),
    )
    sleep_level: int = attrs.field(
        default=1, validator=_sleep_level, metadata=_help("vLLM sleep level used by sleep() where supported")
    )
    engine_kwargs: dict[str, Any] = attrs.field(
        factory=dict, validator=_str_keyed_dict, metadata=_help("extra keyword arguments for vllm.LLM(...)")
    )

    def __attrs_post_init__(self) -> None:
        if self.gpu_memory_utilization is not None and not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization!r}")
        reserved = {"model", "tokenizer", "seed", "worker_extension_cls", "logprobs_mode"}
        clash = sorted(reserved & set(self.engine_kwargs))
        if clash:
            raise ValueError(
                f"engine_kwargs may not set {', '.join(clash)}: the engine sets them itself "
                f"(reserved: {', '.join(sorted(reserved))})"
            )


@attrs.frozen(kw_only=True)
class OpenAIOptions:
    """An OpenAI-compatible completions server: one given by ``base_url``, or a ``vllm serve`` we launch."""

    base_url: str | None = attrs.field(
        default=None, metadata=_help("server root, e.g. http://127.0.0.1:8000/v1 (null with launch: true)")
    )
    model_name: str | None = attrs.field(
        default=None, metadata=_help("the 'model' field of requests (null: the first model the server lists)")
    )
    api_key: str | None = attrs.field(default=None, metadata=_help("bearer token, if the server wants one"))
    launch: bool = attrs.field(
        default=False, metadata=_help("start `vllm serve` on 127.0.0.1 for the policy (enables weight sync)")
    )
    vllm: VLLMOptions = attrs.field(
        factory=VLLMOptions, converter=nested(VLLMOptions), validator=holds(VLLMOptions),
        metadata=_help("options of the launched vLLM server (launch: true only)"),
    )
    max_concurrency: int = attrs.field(
        default=32, validator=optional_positive_int, metadata=_help("requests in flight at once")
    )
    request_timeout_s: float = attrs.field(default=600.0, metadata=_help("seconds to wait for one completion"))
    startup_timeout_s: float = attrs.field(default=600.0, metadata=_help("seconds to wait for a launched server"))

    def __attrs_post_init__(self) -> None:
        if self.launch == (self.base_url is not None):
            raise ValueError(
                f"set exactly one of base_url (an existing server) and launch: true (start vllm serve); "
                f"got base_url={self.base_url!r}, launch={self.launch!r}"
            )
        if self.base_url is not None and not self.base_url.startswith(("http://", "https://")):
            raise ValueError(f"base_url must start with http:// or https://, got {self.base_url!r}")
        if self.request_timeout_s <= 0 or self.startup_timeout_s <= 0:
            raise ValueError("request_timeout_s and startup_timeout_s must be > 0")
