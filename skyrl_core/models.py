"""Loading policies and tokenizers from local directories or configs (never from a model hub)."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

    from skyrl_core.config.schema import ModelConfig

# Refuse hub downloads everywhere skyrl loads models: a typo in a path must not become a download.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


def torch_dtype(name: str) -> torch.dtype:
    import torch

    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[name]


def build_hf_config(config: dict[str, Any]) -> Any:
    """A transformers config from a plain dict that names its ``model_type``."""
    from transformers import AutoConfig

    cfg = dict(config)
    model_type = cfg.pop("model_type", None)
    if model_type is None:
        raise ValueError("model.config needs a 'model_type' (e.g. 'qwen3', 'llama')")
    return AutoConfig.for_model(model_type, **cfg)


def load_causal_lm(model: ModelConfig, *, seed: int = 0, device: str = "cpu") -> torch.nn.Module:
    """The policy as a transformers causal LM in ``model.dtype``, in eval mode.

    From ``model.path`` (a local directory) or built from ``model.config`` with weights initialised
    from ``seed`` (the same seed gives the same weights in every process).
    """
    import torch
    from transformers import AutoModelForCausalLM

    dtype = torch_dtype(model.dtype)
    if model.path is not None:
        if not os.path.isdir(model.path):
            raise FileNotFoundError(f"model.path {model.path!r} is not a directory")
        lm = AutoModelForCausalLM.from_pretrained(model.path, dtype=dtype, attn_implementation="eager")
    else:
        cfg = build_hf_config(model.config or {})
        cfg._attn_implementation = "eager"
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            lm = AutoModelForCausalLM.from_config(cfg, dtype=dtype)
    return lm.to(device).eval()


def load_tokenizer(model: ModelConfig) -> Any:
    """The tokenizer at ``model.tokenizer`` (default ``model.path``).

    A model built from a config without a tokenizer directory gets ``ByteTokenizer``, a small
    byte-level tokenizer with a chat template, so tiny test models need no files.
    """
    path = model.tokenizer or model.path
    if path is None:
        from skyrl_core.byte_tokenizer import ByteTokenizer

        vocab = int((model.config or {}).get("vocab_size", 512))
        return ByteTokenizer(vocab_size=vocab)
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)
