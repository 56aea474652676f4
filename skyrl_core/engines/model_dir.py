"""A Hugging Face model directory that an inference library can load, for any ``ModelConfig``.

vLLM and SGLang load models from disk only. A model given as a local directory is used as it is; a
model given as a config (a tiny random test model) is written out once: random weights from
``skyrl_core.models.load_causal_lm`` (the same seed gives the same weights as the trainer) and, when
it has no tokenizer directory, a ``tokenizers`` file equivalent to skyrl's ``ByteTokenizer`` so
that the library detokenises and matches stop strings exactly as skyrl does.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from typing import TYPE_CHECKING, Any, Iterable

if TYPE_CHECKING:
    from skyrl_core.config.schema import ModelConfig


def _bytes_to_unicode() -> dict[int, str]:
    """The byte-level alphabet of ``tokenizers``' ByteLevel pre-tokenizer/decoder.

    Printable Latin-1 bytes map to themselves; the rest are shifted past 255 so that every byte
    has a visible, distinct character.
    """
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table: dict[int, str] = {}
    shift = 0
    for b in range(256):
        if b in keep:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + shift)
            shift += 1
    return table


def write_byte_tokenizer(directory: str, vocab_size: int) -> None:
    """Write a fast HF tokenizer whose ids match ``skyrl_core.byte_tokenizer.ByteTokenizer``.

    Ids 0..255 are the bytes, 256/257/258 are BOS/EOS/PAD (special), the rest up to ``vocab_size``
    are unused special placeholders (skipped when decoding, as ByteTokenizer does).
    """
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    from skyrl_core.byte_tokenizer import ByteTokenizer

    byte_chars = _bytes_to_unicode()
    vocab = {ch: b for b, ch in byte_chars.items()}
    specials = {ByteTokenizer.BOS: "<|bos|>", ByteTokenizer.EOS: "<|eos|>", ByteTokenizer.PAD: "<|pad|>"}
    for i in range(259, vocab_size):
        specials[i] = f"<|reserved_{i}|>"
    for i, tok in specials.items():
        vocab[tok] = i
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(specials[i], special=True, normalized=False) for i in sorted(specials)])
    tok.save(os.path.join(directory, "tokenizer.json"))
    with open(os.path.join(directory, "tokenizer_config.json"), "w") as f:
        json.dump(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "bos_token": specials[ByteTokenizer.BOS],
                "eos_token": specials[ByteTokenizer.EOS],
                "pad_token": specials[ByteTokenizer.PAD],
                "add_bos_token": False,
                "add_eos_token": False,
                "model_max_length": 1 << 20,
            },
            f,
            indent=1,
        )


def materialize_model(model: ModelConfig, *, seed: int = 0, parent_dir: str | None = None) -> tuple[str, str | None]:
    """Return ``(model_dir, tokenizer_dir)`` for an engine that loads from disk.

    A ``model.path`` is returned unchanged (with ``model.tokenizer`` if set); when that directory's
    tokenizer is skyrl's byte tokenizer (``byte_tokenizer.json``: a tiny model's SFT export or
    checkpoint), its ``tokenizers`` equivalent is written to a new temporary directory under
    ``parent_dir``, the tokenizer directory returned. A ``model.config`` is written to a new
    temporary directory under ``parent_dir`` (the caller removes it): safetensors weights in
    ``model.dtype`` built with ``seed``, its config, and a byte tokenizer unless ``model.tokenizer``
    names one.
    """
    if model.path is not None:
        from skyrl_core.byte_tokenizer import ByteTokenizer

        saved = None if model.tokenizer is not None else ByteTokenizer.from_directory(os.path.expanduser(model.path))
        if saved is None:
            return model.path, model.tokenizer
        tokenizer_dir = tempfile.mkdtemp(prefix="skyrl-engine-tokenizer-", dir=parent_dir)
        write_byte_tokenizer(tokenizer_dir, saved.vocab_size)
        return model.path, tokenizer_dir
    from skyrl_core.models import load_causal_lm

    directory = tempfile.mkdtemp(prefix="skyrl-engine-model-", dir=parent_dir)
    lm = load_causal_lm(model, seed=seed)
    lm.save_pretrained(directory, safe_serialization=True)
    del lm
    if model.tokenizer is not None:
        return directory, model.tokenizer
    vocab_size = int((model.config or {}).get("vocab_size", 512))
    write_byte_tokenizer(directory, vocab_size)
    return directory, directory


def checkpoint_shapes(model_dir: str) -> dict[str, tuple[int, ...]]:
    """Every tensor name the model at ``model_dir`` accepts in a weight update, with its shape.

    These are the names in its safetensors checkpoint (headers only) and the names of the
    transformers model built from its config (on the meta device: no memory), which is what
    trainers export: transformers >= 5 fuses some checkpoint tensors at load (a MoE's per-expert
    ``experts.{i}.gate_proj`` / ``up_proj`` become one ``experts.gate_up_proj``) and vLLM's loaders
    take both forms. With tied input/output embeddings the checkpoint may omit ``lm_head.weight``;
    it is then added with the embedding's shape, because trainers export it.
    """
    import glob

    from safetensors import safe_open

    files = sorted(glob.glob(os.path.join(model_dir, "*.safetensors")))
    if not files:
        raise FileNotFoundError(f"no *.safetensors weights in {model_dir}")
    shapes: dict[str, tuple[int, ...]] = {}
    for path in files:
        with safe_open(path, framework="pt") as f:
            for name in f.keys():
                shapes[name] = tuple(f.get_slice(name).get_shape())
    shapes.update(_transformers_shapes(model_dir))
    embed = shapes.get("model.embed_tokens.weight")
    if embed is not None and LM_HEAD not in shapes:
        shapes[LM_HEAD] = embed
    return shapes


def _transformers_shapes(model_dir: str) -> dict[str, tuple[int, ...]]:
    """The state-dict names and shapes of transformers' model for ``model_dir``'s config (empty when
    transformers cannot build it: the checkpoint's names then stand alone)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    try:
        config = AutoConfig.from_pretrained(model_dir)
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config)
    except Exception:  # noqa: BLE001 - an architecture transformers cannot build (vLLM may still run it)
        return {}
    return {name: tuple(t.shape) for name, t in model.state_dict().items()}


# Where a Hugging Face checkpoint of a decoder keeps its unembedding (a tied model omits it).
LM_HEAD = "lm_head.weight"
INDEX_FILE = "model.safetensors.index.json"
UNTIED_HEAD_FILE = "lm_head.safetensors"


def checkpoint_ties_unembedding(model_dir: str) -> bool:
    """True when the model at ``model_dir`` ties ``lm_head`` to its input embedding (its text
    config's ``tie_word_embeddings``, which vLLM and SGLang follow: they then load no ``lm_head``)."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(model_dir)
    return bool(getattr(config.get_text_config(), "tie_word_embeddings", False))


def untied_model_dir(model_dir: str, directory: str) -> str:
    """``model_dir`` itself when its model does not tie its unembedding; otherwise ``directory``,
    made (once) into the same model untied: the config says ``tie_word_embeddings: false`` and a
    file of its own holds ``lm_head.weight``, a copy of the embedding, so the logits are the same
    bits; every other file is a link to ``model_dir``'s, read through an index. An engine that
    cannot untie a loaded model (vLLM, SGLang) started from it takes an ``lm_head`` of its own in
    weight updates (a LoRA adapter merged into the unembedding only). Costs one vocabulary x
    hidden tensor more."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    if not checkpoint_ties_unembedding(model_dir):
        return model_dir
    source = os.path.abspath(model_dir)
    marker = os.path.join(directory, ".untied-from")
    if os.path.isfile(marker):
        with open(marker) as f:
            if f.read() == source:
                return directory
    parent = os.path.dirname(os.path.abspath(directory)) or "."
    os.makedirs(parent, exist_ok=True)
    staging = tempfile.mkdtemp(prefix=".untied-", dir=parent)
    # Weights are read through an index (written when the source has none), so that every loader
    # reads lm_head's file too: transformers reads a lone model.safetensors and nothing else, so
    # that file is linked under another name.
    weight_map: dict[str, str] = {}
    embedding = None
    for entry in sorted(os.listdir(source)):
        if entry in ("config.json", INDEX_FILE, ".untied-from"):
            continue
        linked = "model-base.safetensors" if entry == "model.safetensors" else entry
        os.symlink(os.path.join(source, entry), os.path.join(staging, linked))
        if entry.endswith(".safetensors"):
            with safe_open(os.path.join(source, entry), framework="pt") as f:
                for name in f.keys():
                    weight_map[name] = linked
                    if embedding is None and name.endswith("embed_tokens.weight"):
                        embedding = f.get_tensor(name)
    if embedding is None:
        shutil.rmtree(staging)
        raise ValueError(f"{model_dir}: its config ties lm_head to the embedding, but no *embed_tokens.weight is in its checkpoint")
    with open(os.path.join(source, "config.json")) as f:
        config = json.load(f)
    config["tie_word_embeddings"] = False
    for value in config.values():  # a nested text config (multimodal models) says it too
        if isinstance(value, dict) and "tie_word_embeddings" in value:
            value["tie_word_embeddings"] = False
    with open(os.path.join(staging, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    save_file({LM_HEAD: embedding.contiguous()}, os.path.join(staging, UNTIED_HEAD_FILE))
    index = os.path.join(source, INDEX_FILE)
    table: dict[str, Any] = {"metadata": {}, "weight_map": weight_map}
    if os.path.isfile(index):
        with open(index) as f:
            table = json.load(f)
    table.setdefault("weight_map", {})[LM_HEAD] = UNTIED_HEAD_FILE
    with open(os.path.join(staging, INDEX_FILE), "w") as f:
        json.dump(table, f, indent=2)
    with open(os.path.join(staging, ".untied-from"), "w") as f:
        f.write(source)
    if os.path.lexists(directory):
        shutil.rmtree(directory)
    os.rename(staging, directory)
    return directory


def check_weights(named: list[tuple[str, object]], shapes: dict[str, tuple[int, ...]]) -> None:
    """Refuse tensors the model does not have, or of another shape, naming the tensor."""
    for name, tensor in named:
        expected = shapes.get(name)
        if expected is None:
            raise ValueError(f"update_weights: the model has no tensor named {name!r}")
        got = tuple(tensor.shape)  # type: ignore[attr-defined]
        if got != expected:
            raise ValueError(f"update_weights: tensor {name!r} has shape {got}, the model's has shape {expected}")


def checked_weights(
    named_tensors: Iterable[tuple[str, Any]], shapes: dict[str, tuple[int, ...]], *, to_cpu: bool = False,
    tied: bool = False,
) -> list[tuple[str, Any]]:
    """``update_weights``' tensors, detached (contiguous on the CPU with ``to_cpu``), refused when there
    are none or when ``check_weights`` refuses them (before any reaches the engine).

    ``tied``: the engine's model ties its unembedding (``checkpoint_ties_unembedding``) and its library loads
    no ``lm_head.weight`` then; one given with other values than the embedding given beside it
    (or alone) would be dropped, so it is refused."""
    named = [(name, t.detach().to("cpu").contiguous() if to_cpu else t.detach()) for name, t in named_tensors]
    if not named:
        raise ValueError("update_weights got no tensors")
    check_weights(named, shapes)
    if tied:
        given = dict(named)
        head = given.get(LM_HEAD)
        embedding = next((t for n, t in given.items() if n.endswith("embed_tokens.weight")), None)
        if head is not None and (embedding is None or not _same_values(head, embedding)):
            raise ValueError(
                f"update_weights: {LM_HEAD!r} is not the embedding given with it, and this engine's model ties them "
                "(tie_word_embeddings): the library would load no lm_head. Start the engine from an untied copy "
                "(skyrl_core.engines.model_dir.untied_model_dir) to give it an lm_head of its own."
            )
    return named


def _same_values(a: Any, b: Any) -> bool:
    import torch

    return a is b or (a.shape == b.shape and torch.equal(a.to("cpu", b.dtype), b.to("cpu")))


def write_weights_file(named: list[tuple[str, object]], directory: str) -> str:
    """Write ``named`` CPU tensors to a new safetensors file in ``directory``; return its path.

    This is how weights reach engine workers in other processes (vLLM's RPC does not carry tensors).
    Tensors sharing storage (tied embeddings) are copied, since safetensors refuses shared storage.
    """
    from safetensors.torch import save_file

    seen: set[int] = set()
    state = {}
    for name, tensor in named:
        ptr = tensor.untyped_storage().data_ptr()  # type: ignore[attr-defined]
        state[name] = tensor.clone() if ptr in seen else tensor  # type: ignore[attr-defined]
        seen.add(ptr)
    fd, path = tempfile.mkstemp(suffix=".safetensors", dir=directory)
    os.close(fd)
    save_file(state, path)
    return path
