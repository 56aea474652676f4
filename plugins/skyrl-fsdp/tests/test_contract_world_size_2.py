"""The training-backend contract suite on two Ray-actor ranks (FSDP2 over gloo on loopback), and
the same training run at world sizes 1 and 2."""

import pytest
import torch

from skyrl_core.config.schema import ModelConfig, TrainerConfig
from skyrl_core.testing.backend_contract import (
    PROMPT_LENGTHS,
    RESPONSE_LENGTHS,
    TINY_QWEN3,
    BackendContract,
    make_batch,
    mean_logprob_loss,
    random_sequences,
)
from skyrl_fsdp.backend import FSDPBackend
from skyrl_fsdp.options import FSDPOptions

pytestmark = pytest.mark.slow


class TestFSDPWorldSize2(BackendContract):
    @pytest.fixture(scope="class")
    @classmethod
    def backend_factory(cls, ray_session):
        return lambda model, trainer, seed: FSDPBackend(model, FSDPOptions(world_size=2, device="cpu", reuse_workers=True), seed=seed, trainer=trainer)


def train_curve(world_size: int, batch, steps: int = 5, micro_batch_size: int = 2) -> tuple[torch.Tensor, list[tuple[float, float]]]:
    trainer = TrainerConfig(lr=1e-3, micro_batch_size=micro_batch_size, lr_schedule="linear", warmup_steps=1, steps=steps)
    with FSDPBackend(ModelConfig(config=dict(TINY_QWEN3)), FSDPOptions(world_size=world_size, device="cpu", reuse_workers=True), trainer=trainer) as backend:
        first_logprobs = backend.forward(batch)
        curve = []
        for _ in range(steps):
            metrics = backend.forward_backward(batch, mean_logprob_loss)
            stats = backend.optim_step()
            curve.append((metrics["loss"], stats["grad_norm"]))
    return first_logprobs, curve


def test_world_sizes_1_and_2_train_the_same_curve(ray_session):
    # Five rows: rank 0 gets three, rank 1 two, so with micro-batches of 2 rank 1 runs one real
    # pass and rank 0 two; gradients must still sum to the whole batch's.
    batch = make_batch(*random_sequences(PROMPT_LENGTHS + (4,), RESPONSE_LENGTHS + (3,), vocab_size=512))
    logprobs_1, curve_1 = train_curve(1, batch)
    logprobs_2, curve_2 = train_curve(2, batch)
    assert (logprobs_1 - logprobs_2).abs().max().item() <= 1e-6
    losses_1, norms_1 = zip(*curve_1)
    losses_2, norms_2 = zip(*curve_2)
    assert losses_2 == pytest.approx(losses_1, rel=1e-4)
    assert norms_2 == pytest.approx(norms_1, rel=1e-4)
    assert losses_1[-1] < losses_1[0]


def test_batch_smaller_than_world_size(ray_session):
    # One row: rank 1 has nothing and runs a filler pass so that rank 0's collectives complete.
    batch = make_batch(*random_sequences((4,), (3,), vocab_size=512))
    logprobs_1, curve_1 = train_curve(1, batch, steps=2)
    logprobs_2, curve_2 = train_curve(2, batch, steps=2)
    assert logprobs_2.shape == (1, 3)
    assert (logprobs_1 - logprobs_2).abs().max().item() <= 1e-6
    assert [loss for loss, _ in curve_2] == pytest.approx([loss for loss, _ in curve_1], rel=1e-5)
    assert [norm for _, norm in curve_2] == pytest.approx([norm for _, norm in curve_1], rel=1e-5)


def test_a_failing_loss_closes_the_backend_instead_of_hanging(ray_session):
    batch = make_batch(*random_sequences((4, 2), (3, 3), vocab_size=512))

    def loss_failing_on_rank_0(logprobs, micro_batch):
        # Rank 0 holds row 0 and fails; rank 1 goes on into backward, where it would wait forever
        # for rank 0's half of the gradient reduction.
        if micro_batch.group_ids[0] == 0:
            raise ValueError("loss blew up")
        return mean_logprob_loss(logprobs, micro_batch)

    backend = FSDPBackend(ModelConfig(config=dict(TINY_QWEN3)), FSDPOptions(world_size=2, device="cpu", reuse_workers=True))
    with pytest.raises(ValueError, match="loss blew up"):
        backend.forward_backward(batch, loss_failing_on_rank_0)
    with pytest.raises(RuntimeError, match="closed"):
        backend.forward(batch)
    backend.close()


def test_ranks_start_again_on_another_port_when_theirs_was_taken(ray_session, monkeypatch):
    """The rendezvous port is chosen free, then bound by rank 0 in its own process; when another
    process took it in between (here: a socket this test holds), rank 0's store fails with
    EADDRINUSE through Ray, and the ranks start again on a new port. The first port is the taken
    one, so the retry is what makes this backend start."""
    import socket

    import skyrl_core.ports as ports

    holder = socket.socket()
    holder.bind(("127.0.0.1", 0))
    holder.listen()
    taken = holder.getsockname()[1]
    chosen: list[int] = []
    original = ports.free_port

    def taken_first() -> int:
        chosen.append(taken if not chosen else original())
        return chosen[-1]

    monkeypatch.setattr(ports, "free_port", taken_first)
    batch = make_batch(*random_sequences((4,), (3,), vocab_size=512))
    try:
        with FSDPBackend(ModelConfig(config=dict(TINY_QWEN3)), FSDPOptions(world_size=2, device="cpu"),
                         trainer=TrainerConfig(micro_batch_size=2)) as backend:
            logprobs = backend.forward(batch)
    finally:
        holder.close()
    assert len(chosen) == 2 and chosen[0] == taken != chosen[1]
    assert torch.isfinite(logprobs).all() and logprobs.numel() > 0
