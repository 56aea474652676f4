"""What the contract suite does not cover: bf16 mixed precision, the entropy keyword, RNG in
checkpoints, tokenizers in exported directories, batch validation."""

import os

import pytest
import torch

from skyrl_core.config.schema import ModelConfig, TrainerConfig
from skyrl_core.testing.backend_contract import (
    PROMPT_LENGTHS,
    RESPONSE_LENGTHS,
    TINY_QWEN3,
    assert_weights_bitwise_equal,
    check_a_failing_call_adds_no_gradient,
    hf_model_with,
    make_batch,
    mean_logprob_loss,
    random_sequences,
    reference_logprobs,
)
from skyrl_core.types import TrainingBatch
from skyrl_fsdp.backend import FSDPBackend
from skyrl_fsdp.options import FSDPOptions

MODEL = ModelConfig(config=dict(TINY_QWEN3))


@pytest.fixture(scope="module")
def sequences():
    return random_sequences(PROMPT_LENGTHS, RESPONSE_LENGTHS, vocab_size=512)


@pytest.fixture(scope="module")
def batch(sequences):
    return make_batch(*sequences)


def backend(**options):
    return FSDPBackend(MODEL, FSDPOptions(device="cpu", **options), trainer=TrainerConfig(lr=3e-3, micro_batch_size=2))


def test_bf16_computes_in_bf16_keeps_fp32_masters_and_trains(batch):
    with backend() as fp32, backend(mixed_precision="bf16") as bf16:
        exact, mixed = fp32.forward(batch), bf16.forward(batch)
        real = batch.attention_mask[:, batch.prompt_len :] == 1
        gap = (exact - mixed)[real].abs()
        assert gap.max().item() > 1e-4, "bf16 gave fp32 numbers: the compute dtype was not applied"
        assert gap.max().item() < 0.1
        assert all(t.dtype == torch.float32 for _, t in bf16.export_weights())
        losses = []
        for _ in range(4):
            losses.append(bf16.forward_backward(batch, mean_logprob_loss)["loss"])
            bf16.optim_step()
        assert losses[-1] < losses[0] - 0.05, losses


def test_a_loss_with_an_entropy_parameter_gets_the_token_entropy(batch, sequences):
    seen = {}

    def loss_with_entropy(logprobs, micro_batch, entropy):
        # Micro-batches come length-sorted (group_ids are row numbers here) and trimmed to their own
        # longest response: put rows back in place and pad back to the batch's response length.
        padded = torch.nn.functional.pad(entropy.detach(), (0, batch.response_len - entropy.shape[1]))
        seen.update(zip(micro_batch.group_ids, padded))
        # Maximise entropy: a backend handing out a detached or wrong tensor would not move it.
        return -(entropy * micro_batch.token_weights).sum(), {"entropy": float((entropy.detach() * micro_batch.loss_mask).sum())}

    with backend() as fsdp:
        hf = hf_model_with(MODEL, dict(fsdp.export_weights()))
        fsdp.forward_backward(batch, loss_with_entropy)
        fsdp.optim_step()
        entropy = torch.stack([seen[row] for row in range(len(batch))])
        expected = torch.zeros_like(entropy)
        with torch.no_grad():
            for i, (prompt, response) in enumerate(zip(*sequences)):
                logits = hf(input_ids=torch.tensor([prompt + response])).logits[0]
                logp = torch.log_softmax(logits[len(prompt) - 1 : len(prompt) + len(response) - 1], -1)
                expected[i, : len(response)] = -(logp.exp() * logp).sum(-1)
        assert (entropy - expected).abs().max().item() < 1e-5
        seen.clear()
        fsdp.forward_backward(batch, loss_with_entropy)
        after = torch.stack([seen[row] for row in range(len(batch))])
        assert (after * batch.token_weights).sum() > (entropy * batch.token_weights).sum()


def test_checkpoint_restores_the_random_state(batch, tmp_path):
    with backend() as fsdp:
        fsdp.forward_backward(batch, mean_logprob_loss)
        fsdp.optim_step()
        fsdp.save_checkpoint(str(tmp_path / "ckpt"))
        after_save = torch.rand(4)
        fsdp.load_checkpoint(str(tmp_path / "ckpt"))
        assert torch.equal(torch.rand(4), after_save)


def test_checkpoint_directory_is_a_transformers_model(batch, sequences, tmp_path):
    from transformers import AutoModelForCausalLM

    with backend() as fsdp:
        fsdp.forward_backward(batch, mean_logprob_loss)
        fsdp.optim_step()
        fsdp.save_checkpoint(str(tmp_path / "ckpt"))
        loaded = AutoModelForCausalLM.from_pretrained(str(tmp_path / "ckpt"), dtype=torch.float32).eval()
        assert (fsdp.forward(batch) - reference_logprobs(loaded, *sequences)).abs().max().item() < 1e-5


def _word_tokenizer(directory: str) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<unk>": 1, **{f"w{i}": i + 2 for i in range(100)}}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=core, pad_token="<pad>", unk_token="<unk>").save_pretrained(directory)


def test_a_model_directory_round_trips_with_its_tokenizer(tmp_path):
    from transformers import AutoTokenizer

    with backend() as fsdp:
        fsdp.save_hf(str(tmp_path / "base"))
    _word_tokenizer(str(tmp_path / "base"))
    with FSDPBackend(ModelConfig(path=str(tmp_path / "base")), FSDPOptions(device="cpu"), trainer=TrainerConfig()) as from_dir:
        from_dir.save_hf(str(tmp_path / "out"))
    assert os.path.isfile(tmp_path / "out" / "tokenizer.json")
    tokenizer = AutoTokenizer.from_pretrained(str(tmp_path / "out"))
    assert tokenizer("w3 w7 nope")["input_ids"] == [5, 9, 1]


def test_malformed_batches_are_refused_with_what_was_given(batch):
    with backend() as fsdp:
        no_prompt = TrainingBatch(
            input_ids=batch.input_ids[:, batch.prompt_len :],
            attention_mask=batch.attention_mask[:, batch.prompt_len :],
            loss_mask=batch.loss_mask,
        )
        with pytest.raises(ValueError, match="no prompt token"):
            fsdp.forward(no_prompt)
        ragged = TrainingBatch(input_ids=batch.input_ids, attention_mask=batch.attention_mask[:, 1:], loss_mask=batch.loss_mask)
        with pytest.raises(ValueError, match=r"input_ids and attention_mask must both be \[B, P \+ R\]"):
            fsdp.forward(ragged)


def test_closed_backend_refuses_calls(batch):
    fsdp = backend()
    fsdp.close()
    fsdp.close()
    with pytest.raises(RuntimeError, match="closed"):
        fsdp.forward(batch)


def test_columns_of_padding_are_trimmed_and_change_nothing(batch):
    # The same rows with 3 more columns of left padding and 2 more of right padding.
    B, P, R = len(batch), batch.prompt_len, batch.response_len
    wide_ids = torch.zeros(B, 3 + P + R + 2, dtype=torch.long)
    wide_mask = torch.zeros_like(wide_ids)
    wide_ids[:, 3 : 3 + P + R], wide_mask[:, 3 : 3 + P + R] = batch.input_ids, batch.attention_mask
    wide_loss_mask = torch.nn.functional.pad(batch.loss_mask, (0, 2))
    wide = TrainingBatch(
        input_ids=wide_ids, attention_mask=wide_mask, loss_mask=wide_loss_mask, token_weights=wide_loss_mask / wide_loss_mask.sum()
    )
    shapes = []

    def loss_recording_shapes(logprobs, micro_batch):
        shapes.append((tuple(micro_batch.input_ids.shape), tuple(micro_batch.loss_mask.shape), tuple(logprobs.shape)))
        return mean_logprob_loss(logprobs, micro_batch)

    with backend() as fsdp:
        tight, padded = fsdp.forward(batch), fsdp.forward(wide)
        assert padded.shape == (B, R + 2)
        assert torch.equal(padded[:, :R].view(torch.int32), tight.view(torch.int32))
        assert torch.all(padded[:, R:] == 0)
        fsdp.forward_backward(wide, loss_recording_shapes)
    # Micro-batches of 2 length-sorted rows keep only their own longest prompt and response:
    # rows 1 and 3 (prompts 7 and 5, responses 2 and 4), then rows 2 and 0 (prompts 1 and 3,
    # responses 5 and 6).
    assert shapes == [((2, 7 + 4), (2, 4), (2, 4)), ((2, 3 + 6), (2, 6), (2, 6))]


def test_activation_checkpointing_applies_and_keeps_the_update(batch):
    def trained(checkpointing):
        trainer = TrainerConfig(lr=3e-3, micro_batch_size=2, activation_checkpointing=checkpointing)
        with FSDPBackend(MODEL, FSDPOptions(device="cpu"), trainer=trainer) as fsdp:
            layers = fsdp._local.model.model.layers
            assert all(getattr(layer, "_skyrl_checkpointed", False) == checkpointing for layer in layers)
            metrics = {**fsdp.forward_backward(batch, mean_logprob_loss), **fsdp.optim_step()}
            return metrics, dict(fsdp.export_weights())

    plain, plain_weights = trained(False)
    recomputed, recomputed_weights = trained(True)
    # recomputation is deterministic: the same loss, gradient norm and updated weights, bit for bit
    assert recomputed["loss"] == plain["loss"] and recomputed["grad_norm"] == plain["grad_norm"]
    assert_weights_bitwise_equal(plain_weights, recomputed_weights)


def test_token_budget_packs_rows_into_fewer_passes_without_changing_the_update(batch):
    """Four rows of at most 12 positions: a budget of 24 puts two rows in a pass, one of 12 one row
    (micro_batch_size 4 would allow all four); the loss and gradient do not depend on the packing."""
    seen = {}

    def results(tokens):
        passes = []

        def loss(logprobs, micro):
            passes.append(tuple(micro.input_ids.shape))
            return mean_logprob_loss(logprobs, micro)

        trainer = TrainerConfig(lr=3e-3, micro_batch_size=4, micro_batch_tokens=tokens)
        with FSDPBackend(MODEL, FSDPOptions(device="cpu"), trainer=trainer) as fsdp:
            metrics = {**fsdp.forward_backward(batch, loss), **fsdp.optim_step()}
        seen[tokens] = passes
        return metrics

    one_row, two_rows = results(12), results(24)
    assert len(seen[12]) == 4 and len(seen[24]) == 2
    assert all(rows * width <= 24 for rows, width in seen[24])
    assert two_rows["loss"] == pytest.approx(one_row["loss"], abs=1e-6)
    assert two_rows["grad_norm"] == pytest.approx(one_row["grad_norm"], rel=1e-5)


def test_keep_gathered_params_gathers_once_per_call_with_the_same_bits(batch, monkeypatch):
    """``keep_gathered_params``: one gather of each FSDP module per forward / forward_backward call
    (not one or two per micro-batch), and the same logprobs, losses and updated weights bit for bit;
    the second step sees the first step's update (the kept copy is freed before the optimizer)."""
    from torch.distributed.fsdp._fully_shard import _fsdp_param_group

    from skyrl_fsdp.gathered import _fsdp_modules

    gathers = []
    group_class = _fsdp_param_group.FSDPParamGroup
    real_unshard = group_class.unshard

    def counted_unshard(group, *args, **kwargs):
        if group._all_gather_result is None and not group.is_unsharded:  # what FSDP gathers (copies, casts)
            gathers.append(group)
        return real_unshard(group, *args, **kwargs)

    monkeypatch.setattr(group_class, "unshard", counted_unshard)

    def run(keep):
        gathers.clear()
        with backend(mixed_precision="bf16", keep_gathered_params=keep) as fsdp:
            scored = fsdp.forward(batch)
            steps = []
            for _ in range(2):
                steps.append({**fsdp.forward_backward(batch, mean_logprob_loss), **fsdp.optim_step()})
            return scored, steps, dict(fsdp.export_weights()), len(gathers), len(_fsdp_modules(fsdp._local.model))

    plain, kept = run(False), run(True)
    assert torch.equal(kept[0].view(torch.int32), plain[0].view(torch.int32))
    assert [(s["loss"], s["grad_norm"]) for s in kept[1]] == [(s["loss"], s["grad_norm"]) for s in plain[1]]
    assert kept[1][1]["loss"] != kept[1][0]["loss"]  # the update reached the second step's gather
    assert_weights_bitwise_equal(plain[2], kept[2])
    modules = kept[4]
    assert kept[3] == 3 * modules  # 3 calls, each module gathered once in each
    # Per micro-batch (2): once in the scoring forward, twice in forward_backward.
    assert plain[3] == (2 + 2 * 2 * 2) * modules


def test_one_rank_reduces_its_gradients_without_dividing_them_and_with_the_same_bits(batch):
    """On one rank FSDP's reduction is a copy: no division by a factor of 1 runs over the gradients
    (the pass it cost), and the update is the bits of the run with that factor set (x / 1 == x)."""
    from torch.distributed.fsdp import FSDPModule
    from torch.utils._python_dispatch import TorchDispatchMode

    class LargeDivisions(TorchDispatchMode):
        def __init__(self, at_least):
            super().__init__()
            self.at_least, self.count = at_least, 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func.overloadpacket is torch.ops.aten.div and args[0].numel() >= self.at_least:
                self.count += 1
            return func(*args, **(kwargs or {}))

    def run(with_factor):
        with backend(mixed_precision="bf16") as fsdp:
            model = fsdp._local.model
            if with_factor:  # what every rank set before (the negative control)
                for module in model.modules():
                    if isinstance(module, FSDPModule):
                        module.set_gradient_divide_factor(1.0)
            layer = min(sum(p.numel() for p in layer.parameters()) for layer in model.model.layers)
            divisions = LargeDivisions(layer)
            with divisions:
                metrics = {**fsdp.forward_backward(batch, mean_logprob_loss), **fsdp.optim_step()}
            return metrics, dict(fsdp.export_weights()), divisions.count

    plain, factored = run(False), run(True)
    assert plain[2] == 0 and factored[2] > 0
    assert (plain[0]["loss"], plain[0]["grad_norm"]) == (factored[0]["loss"], factored[0]["grad_norm"])
    assert_weights_bitwise_equal(plain[1], factored[1])


@pytest.mark.parametrize("accumulating", [False, True])
def test_a_call_that_fails_part_way_adds_no_gradient(batch, accumulating):
    """(the first micro-batch's gradients already reduced into the shards)"""
    check_a_failing_call_adds_no_gradient(backend, batch, accumulating)


def _grouped_batch():
    """Three prompts with 3, 2 and 3 responses each (rows interleaved), as GRPO groups come."""
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(1, 512, (n,), generator=g).tolist() for n in (6, 3, 8)]
    rows = [0, 1, 2, 0, 2, 1, 0, 2]
    responses = [torch.randint(1, 512, (n,), generator=g).tolist() for n in (4, 2, 5, 1, 3, 6, 2, 4)]
    return make_batch([prompts[p] for p in rows], responses)


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_rows_of_one_prompt_are_computed_as_one_sequence_with_the_same_update(precision, monkeypatch):
    """``share_prompts``: each prompt's rows go in one micro-batch and one packed sequence (counted),
    with the logprobs, loss, gradient norm and updated function of rows computed apart (fp32 within
    rounding; bf16 within bf16's)."""
    import skyrl_fsdp.rank as rank_module

    batch = _grouped_batch()
    shared_calls = []
    real = rank_module.shared_prompt_logprobs

    def counted(model, input_ids, *args, **kwargs):
        shared_calls.append(tuple(input_ids.shape))
        return real(model, input_ids, *args, **kwargs)

    monkeypatch.setattr(rank_module, "shared_prompt_logprobs", counted)

    def run(share):
        shared_calls.clear()
        trainer = TrainerConfig(lr=3e-3, micro_batch_size=4)
        with FSDPBackend(MODEL, FSDPOptions(device="cpu", mixed_precision=precision, share_prompts=share), trainer=trainer) as fsdp:
            scored = fsdp.forward(batch)
            metrics = {**fsdp.forward_backward(batch, mean_logprob_loss), **fsdp.optim_step()}
            return scored, metrics, fsdp.forward(batch), list(shared_calls)

    apart, shared = run(False), run(True)
    assert apart[3] == []
    # prompt 1's two rows, prompt 0's three, prompt 2's three (4 rows a pass at most): 3 passes a
    # call, 3 calls
    assert len(shared[3]) == 9 and all(rows <= 4 for rows, _ in shared[3]), shared[3]
    tolerance = 1e-5 if precision == "fp32" else 0.1
    real_tokens = batch.attention_mask[:, batch.prompt_len:].bool()
    assert (shared[0] - apart[0])[real_tokens].abs().max().item() < tolerance
    assert shared[1]["loss"] == pytest.approx(apart[1]["loss"], abs=tolerance)
    assert shared[1]["grad_norm"] == pytest.approx(apart[1]["grad_norm"], rel=1e-4 if precision == "fp32" else 0.05)
    # after the update (Adam: a near-zero gradient's rounding can flip an element's step, so the
    # updated function is compared, not every weight)
    after = 1e-3 if precision == "fp32" else 0.2
    assert (apart[2] - apart[0])[real_tokens].abs().max().item() > 2 * after  # the step moved them
    assert (shared[2] - apart[2])[real_tokens].abs().max().item() < after, (shared[2] - apart[2]).abs().max()
