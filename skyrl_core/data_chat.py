"""Chat datasets for supervised fine-tuning: rows of ``messages``, rendered with the tokenizer's
chat template, with a mask of the assistant tokens the loss is taken on.

A row is ``{"messages": [{"role": ..., "content": ...}, ...]}`` (other columns are ignored), in a
``.jsonl``, ``.json`` or ``.parquet`` file. The assistant tokens of turn ``i`` are found by
rendering the conversation up to the turn with the generation prompt, then up to and including
it: the difference is what the model must write (its content and the template's end-of-turn
tokens). A template that renders earlier turns differently once later ones follow cannot be
split this way and is refused with the row named.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence

import attrs

from skyrl_core.data import ROLES, DatasetError, _read_json, _read_jsonl, _read_parquet

LOSS_ON = ("all_assistant", "last_assistant")


@attrs.frozen
class ChatSample:
    """One rendered conversation: token ids and a 0/1 loss mask over the same positions."""

    input_ids: tuple[int, ...]
    loss_mask: tuple[int, ...]

    def __len__(self) -> int:
        return len(self.input_ids)


def load_chat_dataset(path: str | Path) -> list[dict[str, Any]]:
    """The rows of a chat dataset, each checked to have ``messages`` with an assistant turn."""
    path = Path(path)
    if not path.is_file():
        raise DatasetError(f"dataset file {str(path)!r} does not exist")
    readers = {".jsonl": _read_jsonl, ".json": _read_json, ".parquet": _read_parquet}
    reader = readers.get(path.suffix.lower())
    if reader is None:
        raise DatasetError(f"dataset file {str(path)!r} has suffix {path.suffix!r}; allowed: {', '.join(readers)}")
    rows = reader(path)
    for index, row in enumerate(rows):
        where = f"{path}: row {index}"
        messages = row.get("messages") if isinstance(row, dict) else None
        if not isinstance(messages, list) or not messages:
            raise DatasetError(f"{where} needs a non-empty 'messages' list of {{role, content}} objects")
        for turn, message in enumerate(messages):
            if not isinstance(message, dict) or message.get("role") not in ROLES or not isinstance(message.get("content"), str):
                raise DatasetError(f"{where}: message {turn} must be {{role: one of {', '.join(ROLES)}, content: string}}, "
                                   f"got {message!r:.80}")
        if not any(m["role"] == "assistant" for m in messages):
            raise DatasetError(f"{where} has no assistant message: nothing to learn from")
    return rows


def _ids(rendered: Any) -> list[int]:
    if hasattr(rendered, "keys"):
        rendered = rendered["input_ids"]
    return [int(i) for i in rendered]


def render_chat(tokenizer: Any, messages: Sequence[dict[str, Any]], loss_on: str = "all_assistant",
                where: str = "conversation") -> ChatSample:
    """Token ids of ``messages`` and the mask of the assistant tokens trained on: every assistant
    turn (``all_assistant``) or the last one (``last_assistant``)."""
    if loss_on not in LOSS_ON:
        raise ValueError(f"loss_on must be one of {', '.join(LOSS_ON)}, got {loss_on!r}")
    messages = [{"role": m["role"], "content": m["content"]} for m in messages]
    full = _ids(tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=False))
    mask = [0] * len(full)
    turns = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
    if loss_on == "last_assistant":
        turns = turns[-1:]
    for i in turns:
        before = _ids(tokenizer.apply_chat_template(messages[:i], tokenize=True, add_generation_prompt=True)) if i else []
        upto = _ids(tokenizer.apply_chat_template(messages[:i + 1], tokenize=True, add_generation_prompt=False))
        if full[:len(upto)] != upto or upto[:len(before)] != before or len(upto) <= len(before):
            raise DatasetError(f"{where}: the chat template renders assistant turn {i} differently once other "
                               "messages follow it, so its tokens cannot be located")
        for position in range(len(before), len(upto)):
            mask[position] = 1
    return ChatSample(tuple(full), tuple(mask))
