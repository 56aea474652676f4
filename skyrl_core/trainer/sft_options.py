"""The ``sft:`` config section (registered by the core): how ``skyrl sft`` reads and batches chat data.

Everything else comes from the sections ``skyrl train`` uses: ``model``, ``backend``,
``trainer`` (steps, lr, schedule, micro-batching, eval_every, checkpoint_every, output_dir, seed,
resume, loggers, ...) and ``data`` (``train``/``eval``: chat datasets, ``eval_size``, ``shuffle``).
"""

from __future__ import annotations

import attrs

from skyrl_core.config.schema import _help, _one_of, _positive
from skyrl_core.data_chat import LOSS_ON


@attrs.frozen(kw_only=True)
class SFTOptions:
    loss_on: str = attrs.field(default="all_assistant", validator=_one_of(*LOSS_ON),
                               metadata=_help("assistant tokens the loss is taken on: every assistant turn, or the last"))
    batch_size: int = attrs.field(default=8, validator=_positive, metadata=_help("conversations per optimizer step"))
    max_length: int = attrs.field(default=1024, validator=_positive,
                                  metadata=_help("tokens per conversation; a longer one is refused at the start"))
    pack: bool = attrs.field(default=True, metadata=_help(
        "pack conversations into rows of up to max_length tokens (position ids restart per conversation, "
        "attention stays inside it)"))
    export_hf: bool = attrs.field(default=True, metadata=_help("write <output_dir>/hf, a Hugging Face model directory, at the end"))
