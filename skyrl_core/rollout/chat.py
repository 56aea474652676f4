"""Chat-template arithmetic for token-in/token-out rollouts.

The model's own tokens are never decoded and re-encoded: a conversation's token ids are the prompt
rendered once, then, turn after turn, exactly the ids the engine sampled, followed by the ids of
what the environment said. Only the *new* messages are rendered, as the difference between the
chat template applied to a fixed base conversation with and without them, so the ids match what
the template would produce for the whole conversation without touching earlier tokens.
"""

from __future__ import annotations

from typing import Any, Sequence

from skyrl_core.types import Message

# A fixed conversation the new messages are rendered after. It starts with a system message so
# templates that inject a default system prompt do so in the base, not in the difference.
_BASE: list[Message] = [{"role": "system", "content": "S"}, {"role": "user", "content": "U"}]
# Marks where an assistant turn's content ends in a rendered template.
_PROBE = "SKYRL-TURN-END-PROBE"


class ChatTemplateError(ValueError):
    """The tokenizer's chat template cannot be split into per-message pieces."""


def _ids(rendered: Any) -> list[int]:
    """Token ids from ``apply_chat_template(tokenize=True)`` (a list, or a mapping in transformers 5)."""
    if hasattr(rendered, "keys"):
        rendered = rendered["input_ids"]
    return [int(i) for i in rendered]


class ChatCodec:
    """Renders prompts and environment messages to token ids with one tokenizer's chat template."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.eos_token_id: int | None = tokenizer.eos_token_id
        pad = getattr(tokenizer, "pad_token_id", None)
        self.pad_token_id: int = int(pad if pad is not None else (self.eos_token_id or 0))
        self._after_turn = self._text(_BASE + [{"role": "assistant", "content": _PROBE}])
        self.turn_end_ids = self._turn_end_ids()

    def _text(self, messages: Sequence[Message], generation_prompt: bool = False) -> str:
        return self.tokenizer.apply_chat_template(
            list(messages), tokenize=False, add_generation_prompt=generation_prompt
        )

    def _encode(self, text: str) -> list[int]:
        return [int(i) for i in self.tokenizer.encode(text, add_special_tokens=False)]

    def _turn_end_ids(self) -> list[int]:
        """What the template writes after an assistant message's content (``<|im_end|>\\n``, ...)."""
        at = self._after_turn.rfind(_PROBE)
        if at < 0:
            raise ChatTemplateError("the chat template drops the content of assistant messages")
        return self._encode(self._after_turn[at + len(_PROBE):])

    def render_prompt(self, messages: Sequence[Message]) -> list[int]:
        """The prompt's ids with the generation prompt (``<|im_start|>assistant\\n``) appended."""
        return _ids(self.tokenizer.apply_chat_template(list(messages), tokenize=True, add_generation_prompt=True))

    def close_turn(self, model_ids: Sequence[int]) -> list[int]:
        """Ids that complete the model's turn as the template would have written it.

        A turn that stopped on the template's end-of-turn token (``<|im_end|>``) gets the rest of
        the turn's ending (``\\n``); a truncated turn gets all of it.
        """
        end = self.turn_end_ids
        for k in range(min(len(end), len(model_ids)), 0, -1):
            if list(model_ids[-k:]) == end[:k]:
                return end[k:]
        return list(end)

    def render_messages(self, messages: Sequence[Message]) -> list[int]:
        """Ids of ``messages`` appended after a finished assistant turn, ending with the generation
        prompt for the model's next turn."""
        if not messages:
            raise ValueError("render_messages needs at least one message")
        full = self._text(_BASE + [{"role": "assistant", "content": _PROBE}, *messages], generation_prompt=True)
        if not full.startswith(self._after_turn):
            raise ChatTemplateError(
                "the chat template renders earlier turns differently once messages follow them; "
                "environment messages cannot be rendered incrementally with this template"
            )
        return self._encode(full[len(self._after_turn):])

    def decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=True)
