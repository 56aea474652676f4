"""Chat-template arithmetic: rendering only the new messages reproduces the full template."""

from __future__ import annotations

import pytest

from skyrl_core.byte_tokenizer import ByteTokenizer
from skyrl_core.rollout import ChatCodec, ChatTemplateError
from tests.rollout.chatml import chatml_tokenizer

HISTORY = [{"role": "user", "content": "What is 2 + 3?"}]
OBSERVATION = [{"role": "user", "content": "Tool result: 5"}]


def _ids(rendered):
    return list(rendered["input_ids"] if hasattr(rendered, "keys") else rendered)


def test_incremental_rendering_equals_the_full_template_for_chatml() -> None:
    tokenizer = chatml_tokenizer()
    codec = ChatCodec(tokenizer)
    prompt = codec.render_prompt(HISTORY)
    model_turn = tokenizer.encode("5", add_special_tokens=False) + [tokenizer.eos_token_id]  # stopped on <|im_end|>
    incremental = prompt + model_turn + codec.close_turn(model_turn) + codec.render_messages(OBSERVATION)
    full = _ids(tokenizer.apply_chat_template(
        HISTORY + [{"role": "assistant", "content": "5"}] + OBSERVATION, tokenize=True, add_generation_prompt=True
    ))
    assert incremental == full
    # the template's default system prompt belongs to the prompt only, never to an observation
    assert "default assistant" in tokenizer.decode(prompt)
    assert "default assistant" not in tokenizer.decode(codec.render_messages(OBSERVATION))


def test_close_turn_completes_stopped_and_truncated_turns() -> None:
    tokenizer = chatml_tokenizer()
    codec = ChatCodec(tokenizer)
    eos, newline = tokenizer.eos_token_id, tokenizer.encode("\n", add_special_tokens=False)
    assert codec.turn_end_ids == [eos, *newline]
    assert codec.close_turn([65, 66, eos]) == newline  # stopped on <|im_end|>: only the newline is missing
    assert codec.close_turn([65, 66]) == [eos, *newline]  # truncated: the whole ending


def test_byte_tokenizer_codec_renders_observations_after_a_turn() -> None:
    tokenizer = ByteTokenizer()
    codec = ChatCodec(tokenizer)
    assert codec.pad_token_id == ByteTokenizer.PAD
    assert tokenizer.decode(codec.render_messages(OBSERVATION)) == "<|user|>\nTool result: 5\n<|assistant|>\n"
    assert codec.close_turn([65, ByteTokenizer.EOS]) == [ord("\n")]


def test_template_that_rewrites_earlier_turns_is_refused() -> None:
    # A template whose output depends on the whole conversation (here: a message count up front)
    # cannot be rendered incrementally; the codec says so instead of producing drifting tokens.
    counting = "{{ messages|length }}{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    codec = ChatCodec(chatml_tokenizer(counting))
    with pytest.raises(ChatTemplateError, match="cannot be rendered incrementally"):
        codec.render_messages(OBSERVATION)
