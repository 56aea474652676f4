"""The contract test-suite of ``skyrl_core.interfaces.TrainingBackend``.

A backend's tests subclass ``BackendContract`` and provide a ``backend_factory`` fixture of class
scope (or wider) that returns ``make(model: ModelConfig, trainer: TrainerConfig, seed: int)``::

    class TestMyBackend(BackendContract):
        @pytest.fixture(scope="class")
        @classmethod
        def backend_factory(cls):
            return lambda model, trainer, seed: MyBackend(model, MyOptions(), seed=seed, trainer=trainer)

The suite builds a tiny model from a config (override the ``model_config`` fixture to change it) and
checks, against a plain transformers model holding the backend's exported weights:
- ``forward`` equals an fp32 full forward + log-softmax of each sequence alone, unpadded, within
  ``logprob_atol`` (left-padded prompts and right-padded responses of different lengths, two
  temperatures), and is exactly 0 on padding;
- ``forward_backward`` + ``optim_step`` lower a loss over 5 steps, and its logprobs are ``forward``'s;
- the gradient norm equals plain transformers' backward of the same loss on unpadded sequences;
- micro-batch size 1 and 4 give the same loss and gradient norm (``micro_batch_atol``), weights after
  an AdamW step within ``micro_batch_update_rtol * lr`` and logprobs within ``logprob_atol``;
- a checkpoint round trip (in place, and into a backend built from another seed) repeats the same
  metrics and weights (bitwise when ``exact_resume``);
- ``export_weights`` names, shapes and dtypes match the transformers model's ``state_dict``;
- ``save_hf`` writes a directory ``transformers`` loads back with bitwise-equal weights;
- ``execution_contract()`` carries the op ledger with the trainer sites; ``close`` is idempotent.
"""

from __future__ import annotations

import math
from typing import Any, Callable

import pytest
import torch

from skyrl_core.config.schema import ModelConfig, TrainerConfig
from skyrl_core.types import TrainingBatch

TINY_QWEN3 = {
    "model_type": "qwen3",
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "vocab_size": 512,
    "max_position_embeddings": 256,
    "tie_word_embeddings": True,
}
# The same body with untied input/output embeddings (Llama's layout).
TINY_LLAMA = {**TINY_QWEN3, "model_type": "llama", "tie_word_embeddings": False}

# Prompts of different lengths (left-padded in a batch), responses of different lengths (right-padded).
PROMPT_LENGTHS = (3, 7, 1, 5)
RESPONSE_LENGTHS = (6, 2, 5, 4)


def random_sequences(
    prompt_lengths: tuple[int, ...], response_lengths: tuple[int, ...], *, vocab_size: int, seed: int = 0
) -> tuple[list[list[int]], list[list[int]]]:
    """Random token ids (never the pad id 0) for prompts and responses of the given lengths."""
    gen = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(1, vocab_size, (n,), generator=gen).tolist() for n in prompt_lengths]
    responses = [torch.randint(1, vocab_size, (n,), generator=gen).tolist() for n in response_lengths]
    return prompts, responses


def make_batch(prompts: list[list[int]], responses: list[list[int]], *, pad_id: int = 0) -> TrainingBatch:
    """A ``TrainingBatch`` with left-padded prompts and right-padded responses; ``loss_mask`` on every
    response token, ``token_weights`` for a token mean over the whole batch."""
    P = max(map(len, prompts))
    R = max(map(len, responses))
    B = len(prompts)
    input_ids = torch.full((B, P + R), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((B, P + R), dtype=torch.long)
    for i, (prompt, response) in enumerate(zip(prompts, responses)):
        input_ids[i, P - len(prompt) : P] = torch.tensor(prompt)
        input_ids[i, P : P + len(response)] = torch.tensor(response)
        attention_mask[i, P - len(prompt) : P + len(response)] = 1
    loss_mask = attention_mask[:, P:].float()
    return TrainingBatch(
        input_ids=input_ids,
        attention_mask=attention_mask,
        loss_mask=loss_mask,
        group_ids=tuple(range(B)),
        token_weights=loss_mask / loss_mask.sum(),
    )


def reference_logprobs(
    hf_model: torch.nn.Module, prompts: list[list[int]], responses: list[list[int]], temperature: float = 1.0
) -> torch.Tensor:
    """``[B, R]`` fp32 logprobs of each response from a full forward of its sequence alone, unpadded."""
    R = max(map(len, responses))
    out = torch.zeros(len(prompts), R)
    with torch.no_grad():
        for i, (prompt, response) in enumerate(zip(prompts, responses)):
            ids = torch.tensor([prompt + response])
            logits = hf_model(input_ids=ids).logits[0].float() / temperature
            logp = torch.log_softmax(logits, dim=-1)
            positions = torch.arange(len(prompt) - 1, len(prompt) + len(response) - 1)
            out[i, : len(response)] = logp[positions, torch.tensor(response)]
    return out


def mean_logprob_loss(logprobs: torch.Tensor, batch: TrainingBatch) -> tuple[torch.Tensor, dict[str, float]]:
    """Negative token-mean logprob over the whole batch (sums exactly across micro-batches)."""
    loss = -(logprobs * batch.token_weights).sum()
    return loss, {"tokens": float(batch.loss_mask.sum())}


def check_a_failing_call_adds_no_gradient(make_backend: Callable[[], Any], batch: TrainingBatch, accumulating: bool) -> None:
    """``forward_backward`` whose loss fails at the second micro-batch (the first one's gradients
    already added) leaves the gradients as it found them: none, or (``accumulating``) an earlier
    call's; the next step then gives the bits of a run without the failure. ``batch`` must take
    two micro-batches or more."""
    calls = []

    def failing_second(logprobs: torch.Tensor, micro: TrainingBatch) -> tuple[torch.Tensor, dict[str, float]]:
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("the loss failed")
        return mean_logprob_loss(logprobs, micro)

    with make_backend() as clean, make_backend() as failed:
        if accumulating:
            clean.forward_backward(batch, mean_logprob_loss)
            failed.forward_backward(batch, mean_logprob_loss)
        with pytest.raises(RuntimeError, match="the loss failed"):
            failed.forward_backward(batch, failing_second)
        after_failure = {**failed.forward_backward(batch, mean_logprob_loss), **failed.optim_step()}
        expected = {**clean.forward_backward(batch, mean_logprob_loss), **clean.optim_step()}
        assert after_failure["grad_norm"] == expected["grad_norm"]
        assert_weights_bitwise_equal(dict(clean.export_weights()), dict(failed.export_weights()))


def hf_model_with(model: ModelConfig, weights: dict[str, torch.Tensor]) -> torch.nn.Module:
    """A plain transformers model of ``model``'s architecture holding ``weights`` (fp32, eval)."""
    import attrs

    from skyrl_core.models import load_causal_lm

    hf = load_causal_lm(attrs.evolve(model, dtype="float32"), seed=12345)
    hf.load_state_dict(weights, strict=True)
    return hf.eval()


def bits(t: torch.Tensor) -> torch.Tensor:
    """Integer view of a float tensor, for bitwise comparisons."""
    t = t.detach().contiguous()
    return t.view(torch.int16) if t.element_size() == 2 else t.view(torch.int32)


def assert_weights_bitwise_equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert list(a) == list(b)
    differing = [name for name in a if not torch.equal(bits(a[name]), bits(b[name]))]
    assert not differing, f"weights differ: {differing}"


class BackendContract:
    """Subclass it and provide ``backend_factory`` (class scope); see the module docstring."""

    logprob_atol: float = 1e-5
    micro_batch_atol: float = 1e-6
    grad_norm_rtol: float = 1e-5
    # of lr, see test_micro_batch_size_does_not_change_the_update: measured 2.15e-2 at FSDP world size 2
    # with MKL products (cpu_gemm: torch), below 2e-2 with oneDNN; a per-micro-batch optimizer step or
    # an averaged loss moves the update by about lr
    micro_batch_update_rtol: float = 5e-2
    exact_resume: bool = True  # fp32 on one process: resumed runs must repeat bit for bit

    # --- fixtures ----------------------------------------------------------------------------

    @pytest.fixture(scope="class")
    @classmethod
    def model_config(cls) -> ModelConfig:
        return ModelConfig(config=dict(TINY_QWEN3))

    @pytest.fixture(scope="class")
    @classmethod
    def backend_factory(cls) -> Callable[[ModelConfig, TrainerConfig, int], Any]:
        raise NotImplementedError("a BackendContract subclass must provide the backend_factory fixture")

    @pytest.fixture
    def make_backend(self, backend_factory, model_config):
        """``make(seed=0, **trainer_fields)``; every backend made is closed (twice) after the test."""
        made: list[Any] = []

        def make(seed: int = 0, **trainer_fields: Any) -> Any:
            fields = {"lr": 1e-3, "micro_batch_size": 2, **trainer_fields}
            backend = backend_factory(model_config, TrainerConfig(**fields), seed)
            made.append(backend)
            return backend

        yield make
        for backend in made:
            backend.close()
            backend.close()  # idempotent

    @pytest.fixture(scope="class")
    @classmethod
    def shared_backend(cls, backend_factory, model_config):
        """One backend the read-only tests share (nothing steps it)."""
        backend = backend_factory(model_config, TrainerConfig(lr=1e-3, micro_batch_size=2), 0)
        yield backend
        backend.close()

    @pytest.fixture(scope="class")
    @classmethod
    def sequences(cls, model_config) -> tuple[list[list[int]], list[list[int]]]:
        vocab = int((model_config.config or {}).get("vocab_size", 512))
        return random_sequences(PROMPT_LENGTHS, RESPONSE_LENGTHS, vocab_size=vocab)

    @pytest.fixture(scope="class")
    @classmethod
    def batch(cls, sequences) -> TrainingBatch:
        return make_batch(*sequences)

    # --- forward ---------------------------------------------------------------------------

    @pytest.mark.parametrize("temperature", [1.0, 0.7])
    def test_forward_matches_unpadded_hf_log_softmax(self, shared_backend, model_config, sequences, batch, temperature):
        hf = hf_model_with(model_config, dict(shared_backend.export_weights()))
        expected = reference_logprobs(hf, *sequences, temperature=temperature)
        got = shared_backend.forward(batch, temperature=temperature)
        assert got.shape == expected.shape == batch.loss_mask.shape
        assert got.dtype == torch.float32
        padding = batch.attention_mask[:, batch.prompt_len :] == 0
        assert torch.all(got[padding] == 0)
        assert torch.all(got[~padding] < 0)
        err = (got - expected).abs().max().item()
        assert err <= self.logprob_atol, f"max |forward - HF log-softmax| = {err:.3g} at temperature {temperature}"

    def test_temperature_changes_logprobs(self, shared_backend, batch):
        # A backend that ignored the temperature would pass the test above only by luck of
        # tolerance; make sure the two temperatures really give different numbers.
        hot, cold = shared_backend.forward(batch, temperature=1.0), shared_backend.forward(batch, temperature=0.7)
        real = batch.attention_mask[:, batch.prompt_len :] == 1
        assert (hot[real] - cold[real]).abs().min().item() > 1e-4

    def test_forward_rejects_non_positive_temperature(self, shared_backend, batch):
        with pytest.raises(ValueError, match="temperature"):
            shared_backend.forward(batch, temperature=0.0)

    # --- training --------------------------------------------------------------------------

    def test_training_lowers_the_loss(self, make_backend, batch):
        backend = make_backend(lr=3e-3)
        losses = []
        for step in range(5):
            before = backend.forward(batch)
            metrics = backend.forward_backward(batch, mean_logprob_loss)
            # forward_backward scores with the same numbers forward does (same weights, no step yet).
            expected_loss = -(before * batch.token_weights).sum().item()
            assert metrics["loss"] == pytest.approx(expected_loss, abs=1e-5)
            assert metrics["tokens"] > 0
            stats = backend.optim_step()
            assert stats["lr"] == pytest.approx(3e-3)
            assert math.isfinite(stats["grad_norm"]) and stats["grad_norm"] > 0
            losses.append(metrics["loss"])
        assert all(b < a for a, b in zip(losses, losses[1:])), f"loss did not decrease every step: {losses}"

    def test_gradient_norm_matches_hf_backward(self, make_backend, model_config, sequences, batch):
        backend = make_backend()
        hf = hf_model_with(model_config, dict(backend.export_weights()))
        backend.forward_backward(batch, mean_logprob_loss)
        grad_norm = backend.optim_step()["grad_norm"]
        # The same loss on each sequence alone, unpadded, through plain transformers.
        weights = batch.token_weights
        for i, (prompt, response) in enumerate(zip(*sequences)):
            logits = hf(input_ids=torch.tensor([prompt + response])).logits[0].float()
            logp = torch.log_softmax(logits[len(prompt) - 1 : len(prompt) + len(response) - 1], dim=-1)
            token_logp = logp.gather(-1, torch.tensor(response)[:, None])[:, 0]
            (-(token_logp * weights[i, : len(response)]).sum()).backward()
        expected = torch.nn.utils.clip_grad_norm_(hf.parameters(), float("inf")).item()
        assert grad_norm == pytest.approx(expected, rel=self.grad_norm_rtol)

    def test_micro_batch_size_does_not_change_the_update(self, make_backend, batch):
        lr = 1e-3
        results = []
        for micro_batch_size in (1, 4):
            backend = make_backend(lr=lr, micro_batch_size=micro_batch_size)
            metrics = backend.forward_backward(batch, mean_logprob_loss)
            stats = backend.optim_step()
            results.append((metrics, stats, dict(backend.export_weights()), backend.forward(batch)))
            backend.close()  # one at a time: a multi-process backend holds processes and memory
        (m1, s1, w1, f1), (m4, s4, w4, f4) = results
        assert m1["loss"] == pytest.approx(m4["loss"], abs=self.micro_batch_atol)
        # The gradient: its norm is what shows a micro-batch loss averaged instead of summed (Adam's
        # first update hardly depends on the gradient's scale).
        assert s1["grad_norm"] == pytest.approx(s4["grad_norm"], rel=self.micro_batch_atol)
        # The update: Adam's first step is lr * g / (|g| + eps), which turns summation-order
        # rounding (~1e-8) of gradient entries near eps into up to ~1% of lr; compare relative to lr.
        worst = max((w1[name] - w4[name]).abs().max().item() for name in w1)
        assert worst <= self.micro_batch_update_rtol * lr, f"updated weights differ by {worst:.3g} (lr {lr})"
        assert (f1 - f4).abs().max().item() <= self.logprob_atol

    def test_checkpoint_round_trip_repeats_training(self, make_backend, batch, tmp_path):
        schedule = {"lr_schedule": "cosine", "warmup_steps": 3, "steps": 6}

        def two_steps(backend: Any) -> tuple[list[dict[str, float]], dict[str, torch.Tensor]]:
            trace = []
            for _ in range(2):
                trace.append(backend.forward_backward(batch, mean_logprob_loss))
                trace.append(backend.optim_step())
            return trace, dict(backend.export_weights())

        first = make_backend(seed=0, **schedule)
        first.forward_backward(batch, mean_logprob_loss)
        first.optim_step()
        first.save_checkpoint(str(tmp_path / "ckpt"))
        trace, weights = two_steps(first)
        assert trace[1]["lr"] != trace[3]["lr"], "the schedule should move the LR between these steps"

        first.load_checkpoint(str(tmp_path / "ckpt"))
        again, weights_again = two_steps(first)
        first.close()
        # A fresh backend from another seed starts elsewhere: loading must restore everything.
        other = make_backend(seed=1, **schedule)
        assert not torch.equal(dict(other.export_weights())[next(iter(weights))], weights[next(iter(weights))])
        other.load_checkpoint(str(tmp_path / "ckpt"))
        resumed, weights_resumed = two_steps(other)

        for got, got_weights in ((again, weights_again), (resumed, weights_resumed)):
            if self.exact_resume:
                assert got == trace
                assert_weights_bitwise_equal(got_weights, weights)
            else:
                for a, b in zip(got, trace):
                    assert a == pytest.approx(b, rel=1e-5)

    def test_save_checkpoint_replaces_an_existing_directory(self, shared_backend, tmp_path):
        target = tmp_path / "ckpt"
        shared_backend.save_checkpoint(str(target))
        (target / "stale.txt").write_text("from an older save")
        shared_backend.save_checkpoint(str(target))
        assert not (target / "stale.txt").exists()
        assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]  # no temporary left behind

    def test_load_checkpoint_of_missing_directory_names_it(self, shared_backend, tmp_path):
        with pytest.raises(FileNotFoundError, match="nowhere"):
            shared_backend.load_checkpoint(str(tmp_path / "nowhere"))

    # --- weights out -----------------------------------------------------------------------

    def test_export_weights_match_hf_state_dict(self, shared_backend, model_config):
        expected = hf_model_with(model_config, dict(shared_backend.export_weights())).state_dict()
        exported = list(shared_backend.export_weights())
        assert [name for name, _ in exported] == list(expected)
        for name, tensor in exported:
            assert tensor.shape == expected[name].shape, name
            assert tensor.dtype == torch.float32, name
            assert not hasattr(tensor, "placements"), f"{name} is still a sharded DTensor"

    def test_save_hf_loads_back_in_transformers(self, shared_backend, batch, sequences, tmp_path):
        from transformers import AutoModelForCausalLM

        shared_backend.save_hf(str(tmp_path / "hf"))
        loaded = AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf"), dtype=torch.float32, attn_implementation="eager")
        assert_weights_bitwise_equal(
            {k: v for k, v in loaded.state_dict().items()}, dict(shared_backend.export_weights())
        )
        got = shared_backend.forward(batch)
        expected = reference_logprobs(loaded.eval(), *sequences)
        assert (got - expected).abs().max().item() <= self.logprob_atol

    # --- contract --------------------------------------------------------------------------

    def test_execution_contract_carries_the_trainer_ledger(self, shared_backend):
        contract = shared_backend.execution_contract()
        ledger = contract["ledger"]
        for site in ("trainer_forward", "trainer_score"):
            assert f"logprobs@{site}" in ledger
            assert ledger[f"logprobs@{site}"]["impl"]
        assert not any(key.endswith(("@engine_prefill", "@engine_decode")) for key in ledger)


class CudaBackendContract(BackendContract):
    """``BackendContract`` on one CUDA device. Subclass it and provide ``cuda_backend(model, trainer,
    seed)`` (a classmethod building the backend on CUDA) instead of ``backend_factory``; mark the
    test module ``gpu`` and skip it without CUDA.

    CUDA kernels reduce in other orders than the CPU reference (and embedding backward uses
    atomics): close, not bitwise. The factory turns TF32 off (matmuls and cuDNN) first.
    """

    logprob_atol = 1e-4
    micro_batch_atol = 1e-5
    exact_resume = False

    @classmethod
    def cuda_backend(cls, model: ModelConfig, trainer: TrainerConfig, seed: int) -> Any:
        raise NotImplementedError("a CudaBackendContract subclass must provide cuda_backend")

    @pytest.fixture(scope="class")
    @classmethod
    def backend_factory(cls) -> Callable[[ModelConfig, TrainerConfig, int], Any]:
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
        return cls.cuda_backend


def check_bf16_trains_on_cuda(make: Callable[[ModelConfig, TrainerConfig], Any]) -> None:
    """``make(model, trainer)`` builds a backend with bf16 mixed precision on CUDA; check that its
    execution contract says so, that 4 steps (each with a positive gradient norm) lower the loss by
    more than 0.05, and that exported weights are fp32 on the CPU."""
    batch = make_batch(*random_sequences(PROMPT_LENGTHS, RESPONSE_LENGTHS, vocab_size=512))
    with make(ModelConfig(config=dict(TINY_QWEN3)), TrainerConfig(lr=3e-3, micro_batch_size=2)) as backend:
        contract = backend.execution_contract()
        assert (contract["device"], contract["mixed_precision"]) == ("cuda", "bf16")
        losses = []
        for _ in range(4):
            losses.append(backend.forward_backward(batch, mean_logprob_loss)["loss"])
            stats = backend.optim_step()
            assert stats["grad_norm"] > 0
        assert losses[-1] < losses[0] - 0.05, losses
        assert all(t.dtype == torch.float32 and t.device.type == "cpu" for _, t in backend.export_weights())
