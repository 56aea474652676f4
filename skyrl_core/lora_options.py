"""``LoraOptions``: a LoRA adapter a training backend trains instead of the full weights
(``backend.options.lora`` of skyrl-fsdp and skyrl-megatron). Light: no torch, no peft at import."""

from __future__ import annotations

from typing import Any

import attrs

from skyrl_core.config.validators import holds, nested, positive_int, positive_number


def _lora_targets(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
    from skyrl_core.lora import TARGET_GROUPS  # light: no torch, no peft at import

    unknown = [t for t in value if t not in TARGET_GROUPS]
    if not value or unknown:
        raise ValueError(f"targets must be a non-empty list of {', '.join(TARGET_GROUPS)}; got {list(value)!r}")


@attrs.frozen(kw_only=True)
class LoraOptions:
    """A LoRA adapter (peft's initialisation and names) trained on frozen base weights."""

    rank: int = attrs.field(validator=positive_int, metadata={"help": "LoRA rank r"})
    alpha: float = attrs.field(default=32.0, validator=positive_number, metadata={"help": "scale alpha / r of the adapter's product"})
    targets: tuple[str, ...] = attrs.field(
        default=("attn", "mlp"),
        converter=tuple,
        validator=_lora_targets,
        metadata={"help": "layer groups: attn (q/k/v/o_proj), mlp (gate/up/down_proj), unembed (lm_head; refused on a model that ties it to the embedding)"},
    )


def lora_field(help_text: str) -> Any:
    """A backend option ``lora``: ``None`` or ``LoraOptions`` (a mapping given in Python is
    converted and checked, ``skyrl_core.config.validators.nested``)."""
    return attrs.field(default=None, converter=nested(LoraOptions), validator=holds(LoraOptions, optional=True),
                       metadata={"help": help_text})
