"""A real transformers tokenizer with a ChatML chat template, built in memory (no files from a hub).

Byte-level, no merges: every byte is one token, plus the special tokens ``<|im_start|>``,
``<|im_end|>`` (EOS) and ``<|endoftext|>`` (padding). Its template injects a default system
prompt when the conversation has none, like SmolLM2's and Qwen's.
"""

from __future__ import annotations

from pathlib import Path

CHATML_TEMPLATE = (
    "{% if messages[0]['role'] != 'system' %}<|im_start|>system\nYou are a default assistant.<|im_end|>\n{% endif %}"
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def chatml_tokenizer(template: str = CHATML_TEMPLATE):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    core = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[]))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    core.decoder = decoders.ByteLevel()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=core, eos_token="<|im_end|>", pad_token="<|endoftext|>",
        additional_special_tokens=["<|im_start|>"],
    )
    tokenizer.chat_template = template
    return tokenizer


def save_chatml_tokenizer(directory: str | Path) -> str:
    """Write the tokenizer to ``directory`` (for ``ModelConfig.tokenizer``); return its path."""
    chatml_tokenizer().save_pretrained(str(directory))
    return str(directory)
