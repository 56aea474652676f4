"""A byte-level tokenizer for tiny models built from configs (tests, examples without files).

Token ids 0..255 are bytes; 256 is BOS, 257 EOS, 258 PAD; chat turns are rendered as
``<|role|>\n content \n`` in plain bytes. Mirrors the slice of the transformers tokenizer API that
skyrl uses: ``encode``, ``decode``, ``apply_chat_template``, ``eos_token_id``, ``pad_token_id``.

``save_pretrained(dir)`` writes ``byte_tokenizer.json`` (its vocabulary size), which
``skyrl_core.models.load_tokenizer`` reads back: a tiny model's exported or checkpointed directory
then serves as ``model.path`` of a later run (SFT first, then RL) without tokenizer files.
"""

from __future__ import annotations

import json
import os
from typing import Any, Iterable

MARKER_FILE = "byte_tokenizer.json"
HF_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


class ByteTokenizer:
    BOS, EOS, PAD = 256, 257, 258

    def __init__(self, vocab_size: int = 512) -> None:
        if vocab_size < 259:
            raise ValueError(f"ByteTokenizer needs vocab_size >= 259, got {vocab_size}")
        self.vocab_size = vocab_size
        self.bos_token_id = self.BOS
        self.eos_token_id = self.EOS
        self.pad_token_id = self.PAD
        self.eos_token = "<|eos|>"

    def save_pretrained(self, directory: str) -> None:
        with open(os.path.join(directory, MARKER_FILE), "w", encoding="utf-8") as f:
            json.dump({"tokenizer": "skyrl ByteTokenizer", "vocab_size": self.vocab_size}, f)

    @classmethod
    def from_directory(cls, directory: str) -> "ByteTokenizer | None":
        """The tokenizer ``save_pretrained`` wrote into ``directory``; None if it wrote none there, or
        if a Hugging Face tokenizer was put there too (that one is the directory's tokenizer: a user
        who adds one to a tiny model's export chose it)."""
        path = os.path.join(directory, MARKER_FILE)
        if not os.path.isfile(path) or any(os.path.isfile(os.path.join(directory, f)) for f in HF_TOKENIZER_FILES):
            return None
        with open(path, encoding="utf-8") as f:
            return cls(vocab_size=int(json.load(f)["vocab_size"]))

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        ids = list(text.encode("utf-8"))
        return [self.BOS, *ids] if add_special_tokens else ids

    def __call__(self, text: str, add_special_tokens: bool = False, **_: Any) -> dict[str, list[int]]:
        ids = self.encode(text, add_special_tokens=add_special_tokens)
        return {"input_ids": ids, "attention_mask": [1] * len(ids)}

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = False) -> str:
        out = bytearray()
        for i in ids:
            i = int(i)
            if i < 256:
                out.append(i)
            elif not skip_special_tokens and i == self.EOS:
                out.extend(self.eos_token.encode())
        return out.decode("utf-8", errors="replace")

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        tokenize: bool = True,
        add_generation_prompt: bool = False,
        **_: Any,
    ) -> Any:
        text = "".join(f"<|{m['role']}|>\n{m['content']}\n" for m in messages)
        if add_generation_prompt:
            text += "<|assistant|>\n"
        return [self.BOS, *self.encode(text)] if tokenize else text
