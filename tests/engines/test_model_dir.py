"""The HF directory written for engines that load from disk: byte tokenizer equivalence, checkpoint shapes, weight checks."""

from __future__ import annotations

import random

import pytest
import torch

from skyrl_core.byte_tokenizer import ByteTokenizer
from skyrl_core.config.schema import ModelConfig
from skyrl_core.testing.engine_contract import TINY_QWEN3, TINY_QWEN3_MOE
from skyrl_core.engines.model_dir import check_weights, checkpoint_shapes, materialize_model, write_byte_tokenizer


def test_byte_tokenizer_file_matches_skyrl_byte_tokenizer(tmp_path):
    from transformers import AutoTokenizer

    write_byte_tokenizer(str(tmp_path), 512)
    hf = AutoTokenizer.from_pretrained(str(tmp_path))
    ours = ByteTokenizer(512)
    assert (hf.bos_token_id, hf.eos_token_id, hf.pad_token_id, len(hf)) == (256, 257, 258, 512)
    text = "Hello, wörld!\n\t1+2=3 ✓ <tag> ünïcødé"
    assert hf.encode(text, add_special_tokens=False) == ours.encode(text)
    rng = random.Random(0)
    for _ in range(50):
        ids = [rng.randrange(0, 512) for _ in range(rng.randrange(1, 40))]
        assert hf.decode(ids, skip_special_tokens=True) == ours.decode(ids, skip_special_tokens=True)


def test_materialized_model_holds_the_seeded_weights(tmp_path):
    from safetensors.torch import load_file

    from skyrl_core.models import load_causal_lm

    model = ModelConfig(config=dict(TINY_QWEN3))
    model_dir, tokenizer_dir = materialize_model(model, seed=3, parent_dir=str(tmp_path))
    assert tokenizer_dir == model_dir
    saved = load_file(f"{model_dir}/model.safetensors")
    reference = load_causal_lm(model, seed=3).state_dict()
    name = "model.layers.1.mlp.up_proj.weight"
    assert torch.equal(saved[name], reference[name])
    assert not torch.equal(saved[name], load_causal_lm(model, seed=4).state_dict()[name])  # the seed matters
    shapes = checkpoint_shapes(model_dir)
    assert shapes[name] == (128, 64)
    assert shapes["lm_head.weight"] == shapes["model.embed_tokens.weight"] == (512, 64)  # tied: added
    # A local directory is used as it is.
    assert materialize_model(ModelConfig(path=model_dir), seed=0) == (model_dir, None)


def test_a_directory_holding_the_byte_tokenizer_gets_its_tokenizers_equivalent(tmp_path):
    from transformers import AutoTokenizer

    from skyrl_core.byte_tokenizer import ByteTokenizer

    ByteTokenizer(vocab_size=300).save_pretrained(str(tmp_path))  # what a tiny model's SFT export holds
    model_dir, tokenizer_dir = materialize_model(ModelConfig(path=str(tmp_path)), parent_dir=str(tmp_path))
    assert model_dir == str(tmp_path) and tokenizer_dir != model_dir
    hf = AutoTokenizer.from_pretrained(tokenizer_dir)
    assert hf.encode("7 * 1\n", add_special_tokens=False) == ByteTokenizer().encode("7 * 1\n")
    assert len(hf) == 300 and hf.eos_token_id == ByteTokenizer.EOS
    # a tokenizer named in the config is left as it is
    assert materialize_model(ModelConfig(path=str(tmp_path), tokenizer="tok"), parent_dir=str(tmp_path)) == (str(tmp_path), "tok")


def test_a_hugging_face_tokenizer_beside_the_byte_marker_is_the_directorys_tokenizer(tmp_path):
    from skyrl_core.models import load_tokenizer

    ByteTokenizer(vocab_size=300).save_pretrained(str(tmp_path))
    assert isinstance(load_tokenizer(ModelConfig(path=str(tmp_path))), ByteTokenizer)
    write_byte_tokenizer(str(tmp_path), 300)  # a Hugging Face tokenizer put beside the marker
    assert ByteTokenizer.from_directory(str(tmp_path)) is None
    assert not isinstance(load_tokenizer(ModelConfig(path=str(tmp_path))), ByteTokenizer)
    assert materialize_model(ModelConfig(path=str(tmp_path)), parent_dir=str(tmp_path)) == (str(tmp_path), None)


def test_check_weights_names_the_bad_tensor():
    shapes = {"a.weight": (2, 3)}
    check_weights([("a.weight", torch.zeros(2, 3))], shapes)
    with pytest.raises(ValueError, match="the model has no tensor named 'b.weight'"):
        check_weights([("b.weight", torch.zeros(2, 3))], shapes)
    with pytest.raises(ValueError, match=r"tensor 'a.weight' has shape \(3, 2\), the model's has shape \(2, 3\)"):
        check_weights([("a.weight", torch.zeros(3, 2))], shapes)


def test_checkpoint_shapes_take_the_trainers_fused_moe_names_too(tmp_path):
    """transformers >= 5 saves a MoE's experts one tensor each (the checkpoint format) but holds
    and exports them fused; a weight update may use either form."""
    model_dir, _ = materialize_model(ModelConfig(config=dict(TINY_QWEN3_MOE)), seed=0, parent_dir=str(tmp_path))
    shapes = checkpoint_shapes(model_dir)
    prefix = "model.layers.1.mlp.experts"
    assert shapes[f"{prefix}.7.gate_proj.weight"] == shapes[f"{prefix}.7.up_proj.weight"] == (32, 64)  # checkpoint
    assert shapes[f"{prefix}.gate_up_proj"] == (8, 64, 64)  # transformers' runtime names
    assert shapes[f"{prefix}.down_proj"] == (8, 64, 32)
    assert shapes["model.layers.1.mlp.gate.weight"] == (8, 64)


def test_an_untied_copy_of_a_tied_model_gives_the_same_logits_with_an_lm_head_of_its_own(tmp_path):
    """``untied_model_dir``: a tied model's copy whose config unties and whose lm_head.weight is the
    embedding's bits in a file of its own (other files linked); an untied model is used as it is."""
    import json
    import os

    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from skyrl_core.engines.model_dir import checkpoint_ties_unembedding, untied_model_dir
    from skyrl_core.testing.engine_contract import TINY_LLAMA

    tied, _ = materialize_model(ModelConfig(config=dict(TINY_QWEN3)), seed=1, parent_dir=str(tmp_path))
    assert checkpoint_ties_unembedding(tied)
    copy = untied_model_dir(tied, str(tmp_path / "untied"))
    assert copy == str(tmp_path / "untied") and not checkpoint_ties_unembedding(copy)
    assert os.path.islink(os.path.join(copy, "model-base.safetensors"))
    head = load_file(os.path.join(copy, "lm_head.safetensors"))["lm_head.weight"]
    embedding = load_file(os.path.join(tied, "model.safetensors"))["model.embed_tokens.weight"]
    assert torch.equal(head.view(torch.int32), embedding.view(torch.int32))
    original, untied = AutoModelForCausalLM.from_pretrained(tied), AutoModelForCausalLM.from_pretrained(copy)
    assert untied.lm_head.weight.data_ptr() != untied.model.embed_tokens.weight.data_ptr()  # (its own tensor)
    ids = torch.tensor([[5, 9, 200, 31, 7]])
    with torch.no_grad():
        assert torch.equal(original(input_ids=ids).logits.view(torch.int32), untied(input_ids=ids).logits.view(torch.int32))
    assert untied_model_dir(tied, copy) == copy  # made once: a second call reuses it
    with open(os.path.join(copy, "config.json")) as f:
        assert json.load(f)["tie_word_embeddings"] is False
    llama, _ = materialize_model(ModelConfig(config=dict(TINY_LLAMA)), parent_dir=str(tmp_path))
    assert untied_model_dir(llama, str(tmp_path / "unused")) == llama and not os.path.exists(tmp_path / "unused")


def test_an_engine_whose_tied_model_loads_no_lm_head_refuses_one_other_than_the_embedding():
    """``checked_weights(tied=True)``: an lm_head.weight equal to the embedding given beside it
    passes (a tied trainer's full set names both); another value, or one alone, is refused."""
    from skyrl_core.engines.model_dir import checked_weights

    shapes = {"model.embed_tokens.weight": (4, 2), "lm_head.weight": (4, 2)}
    embedding = torch.randn(4, 2)
    full_set = [("model.embed_tokens.weight", embedding), ("lm_head.weight", embedding.clone())]
    assert len(checked_weights(full_set, shapes, tied=True)) == 2
    for given in ([("model.embed_tokens.weight", embedding), ("lm_head.weight", embedding + 1)], [("lm_head.weight", embedding)]):
        with pytest.raises(ValueError, match="'lm_head.weight' is not the embedding given with it"):
            checked_weights(given, shapes, tied=True)
        assert len(checked_weights(given, shapes)) == len(given)  # (an untied model takes it)
