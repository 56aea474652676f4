"""The in-process trainer's fp32 products: oneDNN or PyTorch's BLAS (``cpu_gemm``; the default, ``auto``, takes the
faster on this machine, ``tests/core/test_gemm_choice.py``)."""

import numpy as np
import pytest
import torch

from skyrl_tinker.trainer import Example, LoraTrainer


def _examples() -> list[Example]:
    rng = np.random.default_rng(0)
    out = []
    for length in (7, 5, 9):
        full = rng.integers(0, 256, size=length + 1)
        out.append(Example(full[:-1].astype(np.int64), {
            "target_tokens": full[1:].astype(np.int64),
            "logprobs": -rng.random(length).astype(np.float32),
            "advantages": rng.normal(size=length).astype(np.float32),
        }))
    return out


def _train(tiny_model: str, cpu_gemm: str) -> tuple[LoraTrainer, list[np.ndarray], dict[str, torch.Tensor]]:
    trainer = LoraTrainer(tiny_model, cpu_gemm=cpu_gemm)
    trainer.create("a", rank=4, alpha=32.0, groups=("attn", "mlp"), seed=1)
    with torch.no_grad():  # a non-zero B, so that the adapter's path computes something
        for name, p in trainer.model.named_parameters():
            if ".lora_B." in name:
                p.copy_(0.05 * torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())))
    logprobs, _ = trainer.forward_backward("a", _examples(), "importance_sampling", None)
    grads = {n: p.grad.clone() for n, p in trainer.model.named_parameters() if p.grad is not None}
    return trainer, logprobs, grads


def test_onednn_products_train_the_adapter_like_blas_ones_within_fp32_rounding(tiny_model):
    onednn, logprobs, grads = _train(tiny_model, "onednn")
    blas, blas_logprobs, blas_grads = _train(tiny_model, "torch")
    # oneDNN computes the base layers' products (the adapter's own stay stock) on peft's cheap
    # unmerged path: the merged path is only for an op plugin's (IsoExec's) own implementations.
    assert onednn.ledger.impl("linear", "trainer_forward").name == "onednn.linear"
    assert onednn.ledger.observed[("linear", "trainer_forward", "onednn.linear")] > 0
    assert not onednn.merged_training and not blas.merged_training
    # (unpatched: the modules' own F.linear, which the ledger does not see)
    assert blas.ledger.impl("linear", "trainer_forward").name == "torch.linear"
    assert not [key for key in blas.ledger.observed if key[0] == "linear"]
    # Only the adapter gets gradients, the same ones up to fp32 rounding.
    assert grads and set(grads) == set(blas_grads) and all(".lora_" in n for n in grads)
    for a, b in zip(logprobs, blas_logprobs):
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-4)
    for name in grads:
        torch.testing.assert_close(grads[name], blas_grads[name], rtol=1e-3, atol=1e-5)


def test_an_unknown_cpu_gemm_is_refused_before_the_model_loads():
    with pytest.raises(ValueError, match="cpu_gemm 'mkl': allowed: auto, onednn, torch"):
        LoraTrainer("/nonexistent", cpu_gemm="mkl")


def test_passes_go_in_order_of_length_and_results_come_back_in_the_callers_order(tiny_model, monkeypatch):
    import skyrl_tinker.trainer as trainer_module

    trainer = LoraTrainer(tiny_model)
    trainer.create("a", rank=4, alpha=32.0, groups=("attn", "mlp"), seed=1)
    examples = _examples()  # lengths 7, 5, 9
    alone = [trainer.forward("a", [e], "importance_sampling", None)[0][0] for e in examples]
    # room for two positions-times-rows of the longest datum: passes of at most two short rows
    monkeypatch.setattr(trainer_module, "MICRO_BATCH_BYTES", 14 * trainer.bytes_per_token)
    plan = list(trainer._micro_batches(examples))
    assert plan == [[1, 0], [2]]  # by length: 5 and 7 pad to 14 positions together; 9 alone
    logprobs, _ = trainer.forward("a", examples, "importance_sampling", None)
    assert [len(x) for x in logprobs] == [7, 5, 9]  # the caller's order, each its own length
    for got, want in zip(logprobs, alone):
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-5)
