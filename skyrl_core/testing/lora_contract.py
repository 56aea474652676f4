"""What every training backend's ``options.lora`` must do, for its own tests to call: the adapter
trains alone, leaves as merged Hugging Face weights that compute what the backend computes, and
resumes exactly from a checkpoint (with its AdamW state, or without it when asked)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

import torch

from skyrl_core.config.schema import ModelConfig
from skyrl_core.testing.backend_contract import (
    PROMPT_LENGTHS,
    RESPONSE_LENGTHS,
    assert_weights_bitwise_equal,
    bits,
    hf_model_with,
    make_batch,
    mean_logprob_loss,
    random_sequences,
    reference_logprobs,
)

# The Hugging Face modules the targets ``attn`` and ``mlp`` adapt.
ATTN_AND_MLP = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def check_lora_trains_alone_exports_merged_and_resumes(make_backend: Callable[[bool], Any], model: ModelConfig,
                                                       tmp_path: Path) -> None:
    """``make_backend(lora)``: a fresh backend of ``model`` (same seed each time), with the adapter
    on ``attn`` and ``mlp`` when ``lora``, else full weights."""
    prompts, responses = random_sequences(PROMPT_LENGTHS, RESPONSE_LENGTHS, vocab_size=512)
    batch = make_batch(prompts, responses)
    with make_backend(False) as full:
        base = dict(full.export_weights())
    with make_backend(True) as backend:
        assert_weights_bitwise_equal(dict(backend.export_weights()), base)  # B starts at zero
        backend.forward_backward(batch, mean_logprob_loss)
        backend.optim_step()
        after = dict(backend.export_weights())
        assert list(after) == list(base)  # plain Hugging Face names, no adapter tensors
        changed = {n for n in after if not torch.equal(bits(after[n]), bits(base[n]))}
        assert changed == {n for n in base if n.rsplit(".", 2)[-2] in ATTN_AND_MLP}  # every adapted layer, nothing else
        # What is exported is what the backend computes: a plain model with these weights agrees.
        assert (backend.forward(batch) - reference_logprobs(hf_model_with(model, after), prompts, responses)).abs().max() < 1e-5

        backend.save_checkpoint(str(tmp_path / "ck"))
        backend.forward_backward(batch, mean_logprob_loss)
        backend.optim_step()
        continued = dict(backend.export_weights())
        adapter = {k: v.clone() for k, v in backend.export_adapter().items()}
    with make_backend(True) as resumed:
        resumed.load_checkpoint(str(tmp_path / "ck"))
        assert_weights_bitwise_equal(dict(resumed.export_weights()), after)
        resumed.forward_backward(batch, mean_logprob_loss)
        resumed.optim_step()
        assert_weights_bitwise_equal(dict(resumed.export_weights()), continued)  # adapter and AdamW state restored
        assert_weights_bitwise_equal(resumed.export_adapter(), adapter)
    with make_backend(True) as fresh:  # weights only: AdamW starts over, so the next step differs
        fresh.load_checkpoint(str(tmp_path / "ck"), optimizer=False)
        fresh.forward_backward(batch, mean_logprob_loss)
        fresh.optim_step()
        moved = fresh.export_adapter()
        assert any(not torch.equal(moved[k], adapter[k]) for k in adapter)
