"""The tensor-parallel paths of ``skyrl_megatron.ops_sites`` on two gloo processes, with stand-in
installed implementations (``F.linear``, ``F.embedding``): each rank's result has the bits of the
same op on the full transformers shapes in one process; megatron's own partial sums (row-parallel)
and all-reduce of zeros (embedding) do not. Gradients are the full computation's, sliced."""

import os
import types

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

pytest.importorskip("megatron.core", reason="megatron-core is not installed")

from skyrl_core.ops import OpLedger, site_scope  # noqa: E402
from skyrl_core.ops.dispatch import OpDispatch  # noqa: E402
from skyrl_core.plugins.records import OpImplSpec  # noqa: E402
from skyrl_core.ports import on_a_free_port  # noqa: E402
from skyrl_megatron import ops_sites  # noqa: E402

pytestmark = pytest.mark.slow

TP = 2
GROUPS, QPG, HEAD = 2, 2, 8  # 2 query groups of 2 heads: q 32 rows, k 16, v 16
HIDDEN, FFN, VOCAB, PADDED = 24, 40, 37, 40
SITE = "trainer_score"


def _dispatch() -> OpDispatch:
    ledger = OpLedger(role="trainer")
    ledger.declare("linear", SITE, OpImplSpec(name="test.linear", op="linear", factory="torch.nn.functional:linear"))
    ledger.declare("embedding", SITE, OpImplSpec(name="test.embedding", op="embedding", factory="torch.nn.functional:embedding"))
    return OpDispatch(ledger)


def _inputs():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(5, 3, HIDDEN, generator=gen)  # [S, B, H] like megatron
    weights = {
        "q": torch.randn(GROUPS * QPG * HEAD, HIDDEN, generator=gen),
        "k": torch.randn(GROUPS * HEAD, HIDDEN, generator=gen),
        "v": torch.randn(GROUPS * HEAD, HIDDEN, generator=gen),
        "gate": torch.randn(FFN, HIDDEN, generator=gen),
        "up": torch.randn(FFN, HIDDEN, generator=gen),
        "down": torch.randn(HIDDEN, FFN, generator=gen) * 3,
        "lm_head": torch.randn(VOCAB, HIDDEN, generator=gen),
        "embed": torch.randn(VOCAB, HIDDEN, generator=gen),
    }
    weights["embed"][3, :5] = -0.0  # signed zeros must survive the embedding
    h = torch.randn(5, 3, FFN, generator=gen) * 3
    ids = torch.randint(0, VOCAB, (3, 5), generator=gen)
    ids[0, 0] = 3
    upstream = torch.randn(5, 3, HIDDEN, generator=gen)
    upstream_fc1 = torch.randn(5, 3, FFN, generator=gen)  # a rank's fc1 output: FFN / TP gate + FFN / TP up columns
    return x, weights, h, ids, upstream, upstream_fc1


def _fc1_rows(rank: int) -> torch.Tensor:
    mine = torch.arange(rank * FFN // TP, (rank + 1) * FFN // TP)
    return torch.cat([mine, FFN + mine])


def _module(dispatch, name, weight, **extra):
    return types.SimpleNamespace(
        _skyrl_dispatch=dispatch, _skyrl_name=name, weight=weight, tp_group=dist.group.WORLD, bias=None,
        skip_bias_add=True, sequence_parallel=False, explicit_expert_comm=False, **extra,
    )


def _megatron_qkv(q, k, v):
    """Columns of the separate q/k/v outputs in megatron's fused, per-group order."""
    lead = q.shape[:-1]
    return torch.cat([q.reshape(*lead, GROUPS, -1), k.reshape(*lead, GROUPS, -1), v.reshape(*lead, GROUPS, -1)], -1)


def _worker(rank: int, port: int, out: dict) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=TP)
    torch.set_num_threads(1)
    try:
        x, w, h, ids, upstream, upstream_fc1 = _inputs()
        dispatch = _dispatch()
        result = {}
        with site_scope(SITE):
            # Column-parallel linear_qkv: this rank holds query group `rank`.
            fused = torch.cat([w[n].reshape(GROUPS, -1, HIDDEN) for n in ("q", "k", "v")], 1).reshape(-1, HIDDEN)
            local_qkv = fused.chunk(TP)[rank].clone()
            module = _module(dispatch, "linear_qkv", local_qkv, gather_output=False)
            module._skyrl_columns = ops_sites.ColumnLayout.fused_qkv(GROUPS, QPG, HEAD)
            result["qkv"] = ops_sites._column_forward(module, x)[0]

            # Column-parallel linear_fc1: [gate_r; up_r].
            local_fc1 = torch.cat([w["gate"], w["up"]])[_fc1_rows(rank)].clone().requires_grad_(True)
            module = _module(dispatch, "linear_fc1", local_fc1, gather_output=False)
            module._skyrl_columns = ops_sites.ColumnLayout.gate_up(FFN, TP)
            xg = x.clone().requires_grad_(True)
            fc1 = ops_sites._column_forward(module, xg)[0]
            (fc1 * upstream_fc1).sum().backward()
            result["fc1"], result["fc1_wgrad"], result["fc1_xgrad"] = fc1.detach(), local_fc1.grad, xg.grad

            # Column-parallel output layer over a vocabulary padded from 37 to 40 rows.
            padded = torch.cat([w["lm_head"], torch.zeros(PADDED - VOCAB, HIDDEN)])
            module = _module(dispatch, "output_layer", padded.chunk(TP)[rank].clone(), gather_output=False)
            module._skyrl_columns = ops_sites.ColumnLayout.plain(PADDED, VOCAB)
            result["logits"] = ops_sites._column_forward(module, x)[0]

            # Row-parallel linear_fc2: this rank holds columns `rank` of down_proj and of its input.
            local_down = w["down"].chunk(TP, dim=1)[rank].clone().requires_grad_(True)
            local_h = h.chunk(TP, dim=-1)[rank].clone().requires_grad_(True)
            module = _module(dispatch, "linear_fc2", local_down, input_is_parallel=True)
            y = ops_sites._row_forward(module, local_h)[0]
            (y * upstream).sum().backward()
            result["row"], result["row_wgrad"], result["row_xgrad"] = y.detach(), local_down.grad, local_h.grad
            partial = F.linear(local_h.detach(), local_down.detach())
            dist.all_reduce(partial)
            result["row_partial_sums"] = partial  # megatron's way: not the full GEMM's bits

            # Vocabulary-parallel embedding (rows 0..19 on rank 0, 20..39 on rank 1).
            table = torch.cat([w["embed"], torch.zeros(PADDED - VOCAB, HIDDEN)]).chunk(TP)[rank].clone()
            per = PADDED // TP
            module = _module(
                dispatch, "word_embeddings", table, reduce_scatter_embeddings=False,
                vocab_start_index=rank * per, vocab_end_index=(rank + 1) * per,
            )
            result["embedding"] = ops_sites._embedding_forward(module, ids)
            outside = (ids < rank * per) | (ids >= (rank + 1) * per)
            summed = F.embedding((ids - rank * per).masked_fill(outside, 0), table)
            summed[outside] = 0.0
            dist.all_reduce(summed)
            result["embedding_all_reduce"] = summed  # megatron's way
        out[rank] = result
    finally:
        dist.destroy_process_group()


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int32)


@pytest.fixture(scope="module")
def results():
    with mp.Manager() as manager:
        out = manager.dict()
        on_a_free_port(lambda port: mp.spawn(_worker, args=(port, out), nprocs=TP, join=True))
        return dict(out)


def test_column_parallel_ranks_keep_their_columns_of_the_separate_projections(results):
    x, w, _, _, _, _ = _inputs()
    qkv = _megatron_qkv(F.linear(x, w["q"]), F.linear(x, w["k"]), F.linear(x, w["v"]))  # [S, B, G, per group]
    gate, up = F.linear(x, w["gate"]), F.linear(x, w["up"])
    logits = torch.cat([F.linear(x, w["lm_head"]), torch.zeros(*x.shape[:-1], PADDED - VOCAB)], -1)
    for rank in range(TP):
        got = results[rank]
        assert torch.equal(_bits(got["qkv"]), _bits(qkv[..., rank, :]))
        assert torch.equal(_bits(got["fc1"]), _bits(torch.cat([gate.chunk(TP, -1)[rank], up.chunk(TP, -1)[rank]], -1)))
        assert torch.equal(_bits(got["logits"]), _bits(logits.chunk(TP, -1)[rank]))


def test_row_parallel_output_is_the_full_gemm_on_every_rank(results):
    _, w, h, _, upstream, _ = _inputs()
    full = F.linear(h, w["down"])
    for rank in range(TP):
        assert torch.equal(_bits(results[rank]["row"]), _bits(full))
    # Negative control: megatron's partial GEMMs over K halves, all-reduced, round differently.
    assert not torch.equal(_bits(results[0]["row_partial_sums"]), _bits(full))
    assert (results[0]["row_partial_sums"] - full).abs().max() < 1e-4
    # Gradients: this rank's slice of the full computation's.
    down, hh = w["down"].clone().requires_grad_(True), h.clone().requires_grad_(True)
    (F.linear(hh, down) * upstream).sum().backward()
    for rank in range(TP):
        torch.testing.assert_close(results[rank]["row_wgrad"], down.grad.chunk(TP, dim=1)[rank])
        torch.testing.assert_close(results[rank]["row_xgrad"], hh.grad.chunk(TP, dim=-1)[rank])


def test_column_parallel_gradients_are_the_shards_and_the_summed_input_gradient(results):
    x, w, _, _, _, upstream_fc1 = _inputs()
    weight = torch.cat([w["gate"], w["up"]]).requires_grad_(True)
    xx = x.clone().requires_grad_(True)
    sum((F.linear(xx, weight[_fc1_rows(rank)]) * upstream_fc1).sum() for rank in range(TP)).backward()
    for rank in range(TP):
        torch.testing.assert_close(results[rank]["fc1_wgrad"], weight.grad[_fc1_rows(rank)])
        # megatron's column-parallel input gradient: all-reduced over the ranks' terms.
        torch.testing.assert_close(results[rank]["fc1_xgrad"], xx.grad)


def test_embedding_selects_the_owner_row_bit_for_bit(results):
    _, w, _, ids, _, _ = _inputs()
    full = F.embedding(ids, w["embed"])
    for rank in range(TP):
        assert torch.equal(_bits(results[rank]["embedding"]), _bits(full))
    # Negative control: the all-reduce of zeros turns -0.0 into +0.0 (equal values, other bits).
    assert torch.equal(results[0]["embedding_all_reduce"], full)
    assert not torch.equal(_bits(results[0]["embedding_all_reduce"]), _bits(full))
