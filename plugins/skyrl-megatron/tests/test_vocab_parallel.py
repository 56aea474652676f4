"""Vocabulary-parallel logprobs, entropy and gather on two gloo processes, against one process's
full-vocabulary computation (values and gradients)."""

import os

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from skyrl_core.ports import on_a_free_port
from skyrl_megatron import logprobs as vp

VOCAB = 37  # real entries; the two ranks hold 20 each, the last 3 are padding


def _inputs():
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 5, 40, generator=gen) * 3
    targets = torch.randint(0, VOCAB, (3, 5), generator=gen)
    upstream = torch.randn(3, 5, generator=gen)
    return logits, targets, upstream


def _reference():
    logits, targets, upstream = _inputs()
    full = logits[..., :VOCAB].clone().requires_grad_(True)
    logp = torch.log_softmax(full, dim=-1)
    picked = logp.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    entropy = -(logp.exp() * logp).sum(-1)
    (picked * upstream + entropy * upstream.flip(0)).sum().backward()
    grad = torch.cat([full.grad, torch.zeros(3, 5, 40 - VOCAB)], dim=-1)
    return picked.detach(), entropy.detach(), grad


def _worker(rank: int, port: int, out: dict) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        logits, targets, upstream = _inputs()
        mine = logits[..., rank * 20 : (rank + 1) * 20].clone().requires_grad_(True)
        group = dist.group.WORLD
        picked = vp.vocab_parallel_logprobs(mine, targets, vocab_start=rank * 20, vocab_size=VOCAB, group=group)
        entropy = vp.vocab_parallel_entropy(mine, vocab_start=rank * 20, vocab_size=VOCAB, group=group)
        (picked * upstream + entropy * upstream.flip(0)).sum().backward()
        gathered = vp.gather_vocab(mine, group)
        out[rank] = (picked.detach(), entropy.detach(), mine.grad, gathered.detach())
    finally:
        dist.destroy_process_group()



def test_two_ranks_compute_the_full_vocabulary_result():
    with mp.Manager() as manager:
        out = manager.dict()
        on_a_free_port(lambda port: mp.spawn(_worker, args=(port, out), nprocs=2, join=True))
        results = dict(out)
    picked, entropy, grad = _reference()
    logits, _, _ = _inputs()
    for rank in (0, 1):
        got_picked, got_entropy, got_grad, gathered = results[rank]
        assert (got_picked - picked).abs().max().item() < 1e-5
        assert (got_entropy - entropy).abs().max().item() < 1e-5
        # Each rank's gradient is its slice of the full one (padding entries get none).
        assert (got_grad - grad[..., rank * 20 : (rank + 1) * 20]).abs().max().item() < 1e-5
        assert torch.equal(gathered, logits)
    # Negative control: counting the padding entries as real changes the normaliser.
    with_padding = torch.log_softmax(logits, -1).gather(-1, _inputs()[1].unsqueeze(-1)).squeeze(-1)
    assert (with_padding - picked).abs().max().item() > 1e-3


def test_one_rank_without_a_group_matches_log_softmax():
    logits, targets, _ = _inputs()
    got = vp.vocab_parallel_logprobs(logits, targets, vocab_start=0, vocab_size=40, group=None)
    expected = torch.log_softmax(logits, -1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    assert (got - expected).abs().max().item() < 1e-5


if __name__ == "__main__":  # spawn re-imports this module in the children
    os.environ.setdefault("OMP_NUM_THREADS", "1")
