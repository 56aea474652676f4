"""Each op IsoExec computes inside vLLM gives the trainer's bits, op by op (no engine started):
vLLM's layers routed by skyrl-vllm's op sites to IsoExec's installed ops, and IsoExec's own
paged attention.

The reference is what the trainer's transformers model computes at that op with IsoExec on; the
negative control is vLLM's own op on the same inputs (which differs, so each test can fail).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from skyrl_isoexec import state
from skyrl_isoexec.kernels import attention as canonical_attention
from skyrl_isoexec.kernels import elementwise, logprobs
from skyrl_isoexec.parity import bits, build_model

vllm_config = pytest.importorskip("vllm.config")


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


@pytest.fixture
def vllm_modules():
    """Build vLLM modules as the engine's worker does: inside a vLLM config, IsoExec on."""
    with state.enabled_scope(True), vllm_config.set_current_vllm_config(vllm_config.VllmConfig()):
        yield


def _routed(module: torch.nn.Module) -> torch.nn.Module:
    """``module`` (one of vLLM's layers) routed as skyrl-vllm's op sites route a built model, to the
    implementations installed with IsoExec on; call it inside ``site_scope("engine_prefill")``."""
    from skyrl_core.ops import prepare_model
    from skyrl_core.ops.dispatch import attach_dispatch
    from skyrl_core.ops.engine_layers import route_layers
    from skyrl_vllm.op_sites import layer_classes, routed_ops

    holder = torch.nn.Module()
    holder.layer = module
    with state.enabled_scope(True):
        ledger = prepare_model(None, "engine")
    record = route_layers(holder, attach_dispatch(holder, ledger), routed_ops(ledger), layer_classes())
    assert record.named == ["layer"] and record.unpatched == []
    return module


@pytest.mark.parametrize("family", ["qwen3", "llama"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_rotary_matches_the_trainers_transformers_rotary(vllm_modules, family, dtype):
    from vllm.model_executor.layers.rotary_embedding.base import RotaryEmbedding

    from skyrl_core.ops import site_scope

    model, _ = build_model(family, dtype, enabled=True, wide=True)
    attn = model.model.layers[0].self_attn
    modeling = __import__(type(attn).__module__, fromlist=["apply_rotary_pos_emb"])
    rotary = model.model.rotary_emb
    heads, kv_heads, dim = model.config.num_attention_heads, model.config.num_key_value_heads, attn.head_dim
    theta = model.config.rope_parameters["rope_theta"]
    torch_dtype = getattr(torch, dtype)
    positions = torch.tensor([0, 1, 2, 700, 5, 6, 300, 301])
    q = torch.randn(len(positions), heads, dim, generator=_gen(0)).to(torch_dtype)
    k = torch.randn(len(positions), kv_heads, dim, generator=_gen(1)).to(torch_dtype)

    # Trainer: canonical cos/sin (IsoExec's rope op), transformers' own rotation, [B, H, T, D].
    cos, sin = elementwise.rope(rotary.inv_freq, float(rotary.attention_scaling), positions[None], torch_dtype)
    want_q, want_k = modeling.apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos, sin)
    want_q, want_k = want_q[0].transpose(0, 1), want_k[0].transpose(0, 1)

    routed = _routed(RotaryEmbedding(dim, dim, 1024, theta, True, torch_dtype))
    assert int((bits(routed._skyrl_inv_freq) != bits(rotary.inv_freq)).sum()) == 0
    with site_scope("engine_prefill"):
        got_q, got_k = routed(positions, q.reshape(len(positions), -1), k.reshape(len(positions), -1))
    assert int((bits(got_q.view_as(q)) != bits(want_q)).sum()) == 0
    assert int((bits(got_k.view_as(k)) != bits(want_k)).sum()) == 0
    if dtype == "bfloat16":  # vLLM's own (C++) CPU rotary rounds differently
        stock = RotaryEmbedding(dim, dim, 1024, theta, True, torch_dtype)
        stock_q, _ = stock.forward_cpu(positions, q.reshape(len(positions), -1).clone(), k.reshape(len(positions), -1).clone())
        assert int((bits(stock_q.view_as(q)) != bits(want_q)).sum()) > 0


def test_rotary_keeps_its_lookup_only_for_the_same_positions(vllm_modules):
    # A routed rotary keeps the cos/sin of its last positions (the layers of a step share them);
    # other positions, even of the same count and in a reused buffer, must be looked up again.
    from vllm.model_executor.layers.rotary_embedding.base import RotaryEmbedding

    from skyrl_core.ops import site_scope

    heads, dim = 4, 32
    buffer = torch.tensor([3, 9, 27, 81, 5])
    q = torch.randn(5, heads * dim, generator=_gen(0))
    k = torch.randn(5, 2 * dim, generator=_gen(1))
    routed = _routed(RotaryEmbedding(dim, dim, 1024, 10000.0, True, torch.float32))
    with site_scope("engine_prefill"):
        first = routed(buffer, q, k)
        assert all(torch.equal(bits(a), bits(b)) for a, b in zip(first, routed(buffer, q, k)))
        buffer.copy_(torch.tensor([4, 9, 27, 81, 6]))  # vLLM rewrites its positions buffer in place
        moved_q, moved_k = routed(buffer, q, k)
        fresh_q, fresh_k = _routed(RotaryEmbedding(dim, dim, 1024, 10000.0, True, torch.float32))(buffer, q, k)
        assert torch.equal(bits(moved_q), bits(fresh_q)) and torch.equal(bits(moved_k), bits(fresh_k))
        assert not torch.equal(bits(moved_q), bits(first[0]))
        only_q, no_key = routed(buffer, q)
    assert no_key is None and torch.equal(bits(only_q), bits(fresh_q))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_rms_norm_rounds_the_residual_add_like_the_trainer(vllm_modules, dtype):
    from vllm.model_executor.layers.layernorm import RMSNorm

    from skyrl_core.ops import site_scope

    model, _ = build_model("qwen3", dtype, enabled=True, wide=True)
    hf_norm = model.model.layers[0].post_attention_layernorm  # patched by prepare_model
    hidden = model.config.hidden_size
    torch_dtype = getattr(torch, dtype)
    residual = torch.randn(40, hidden, generator=_gen(0)).to(torch_dtype)
    x = torch.randn(40, hidden, generator=_gen(1)).to(torch_dtype)
    with torch.no_grad(), site_scope("trainer_forward"):
        summed = residual + x  # the decoder layer's residual add, in the model dtype
        want = hf_norm(summed)

    routed = RMSNorm(hidden, eps=hf_norm.variance_epsilon, dtype=torch_dtype)
    routed.weight.data.copy_(hf_norm.weight.data)
    _routed(routed)
    with torch.no_grad(), site_scope("engine_prefill"):
        got, got_residual = routed(x, residual)
        alone = routed(summed)
    assert int((bits(got) != bits(want)).sum()) == 0
    assert int((bits(got_residual) != bits(summed)).sum()) == 0
    assert int((bits(alone) != bits(want)).sum()) == 0
    stock = RMSNorm(hidden, eps=hf_norm.variance_epsilon, dtype=torch_dtype)
    stock.weight.data.copy_(hf_norm.weight.data)
    stock_out, _ = stock.forward_native(x.clone(), residual.clone())
    assert int((bits(stock_out) != bits(want)).sum()) > 0  # vLLM normalises the unrounded fp32 sum


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_full_log_softmax_gathers_to_the_trainers_token_logprobs(dtype):
    # vLLM's op site for the sampler calls the installed logprobs' full_log_softmax form.
    full_log_softmax = logprobs.logprobs.full_log_softmax

    logits = (torch.randn(70, 49152, generator=_gen(0)) * 4).to(dtype)
    ids = torch.randint(0, 49152, (70,), generator=_gen(1))
    want = logprobs.logprobs(logits, ids)
    for rows in (slice(0, 70), slice(3, 4), slice(10, 13)):
        got = full_log_softmax(logits[rows]).gather(-1, ids[rows, None])[:, 0]
        assert int((bits(got) != bits(want[rows])).sum()) == 0
    # Since logprobs v2 the canonical log-softmax is torch's, which vLLM's own compute_logprobs
    # also calls: routing pins the op to the contract and attests it, the bits agree.
    stock = torch.log_softmax(logits, -1, dtype=torch.float32).gather(-1, ids[:, None])[:, 0]  # vLLM's own
    assert int((bits(stock) != bits(want)).sum()) == 0
    # Control: another exact formula of the same value rounds differently on almost every row.
    x = logits.float()
    other = (x - torch.logsumexp(x, -1, keepdim=True)).gather(-1, ids[:, None])[:, 0]
    assert int((bits(other) != bits(want)).sum()) > 0


def test_prepacked_weights_give_the_canonical_linear_bits():
    # vLLM's routed fp32 linears compute from a weight reordered once for oneDNN
    # (``onednn.prepack_if_same_bits``, called by skyrl-vllm's op sites): the canonical GEMM's own
    # kernel without its per-call reorder. Every row count (padded to 8 by the canonical linear),
    # 1 and 2 threads, SmolLM2's and the presets' shapes.
    from skyrl_core.ops.onednn import prepack_if_same_bits
    from skyrl_isoexec.kernels import linear as canonical

    def _prepack(weight):
        return prepack_if_same_bits(weight, canonical.linear)

    before = torch.get_num_threads()
    shapes = [(960, 576), (576, 576), (3072, 576), (576, 1536), (49152, 576), (256, 64), (64, 128)]
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            for n, k in shapes:
                weight = torch.randn(n, k, generator=_gen(n + k))
                packed = _prepack(weight)
                assert packed is not None and packed.is_mkldnn
                for rows in (1, 3, 8, 13, 64, 72, 200):
                    x = torch.randn(rows, k, generator=_gen(rows))
                    got, want = canonical.linear(x, packed), canonical.linear(x, weight)
                    assert int((bits(got) != bits(want)).sum()) == 0, (threads, n, k, rows)
    finally:
        torch.set_num_threads(before)
    # Control: the comparison sees a change of summation order alone (the same products, K summed in
    # two halves), on any CPU. (oneDNN's kernel for one unpadded row also differs on AVX-512 CPUs,
    # but gives the padded rows' bits on an AVX2-only AMD EPYC: not a control that holds everywhere.)
    weight, x = torch.randn(576, 1536, generator=_gen(1)), torch.randn(8, 1536, generator=_gen(2))
    halves = canonical.linear(x[:, :768], weight[:, :768]) + canonical.linear(x[:, 768:], weight[:, 768:])
    assert int((bits(halves) != bits(canonical.linear(x, _prepack(weight)))).sum()) > 0
    # Where the canonical GEMM is not oneDNN's fp32 one, nothing is prepacked.
    assert _prepack(weight.to(torch.bfloat16)) is None and _prepack(torch.randn(4, 64)) is None


def _paged(lengths, kv_heads, dim, block_size, dtype, seed, kv_seed=None):
    """Keys/values of each sequence, and a KV cache holding them in shuffled blocks via ``write_kv``
    (block order from ``seed``, contents from ``kv_seed``: two layers of one model share the order)."""
    kv_seed = seed if kv_seed is None else kv_seed
    from skyrl_isoexec.vllm.attention import write_kv

    blocks_each = [-(-n // block_size) for n in lengths]
    order = torch.randperm(sum(blocks_each) + 1, generator=_gen(seed))[: sum(blocks_each)]
    cache = torch.full((sum(blocks_each) + 1, kv_heads, block_size, 2 * dim), float("nan"), dtype=dtype)
    tables, keys, values, used = [], [], [], 0
    for i, n in enumerate(lengths):
        table = order[used : used + blocks_each[i]]
        used += blocks_each[i]
        tables.append(F.pad(table, (0, max(blocks_each) - len(table))))
        k = torch.randn(n, kv_heads, dim, generator=_gen(kv_seed + 10 + i)).to(dtype)
        v = torch.randn(n, kv_heads, dim, generator=_gen(kv_seed + 20 + i)).to(dtype)
        slots = table[torch.arange(n) // block_size] * block_size + torch.arange(n) % block_size
        write_kv(cache, k, v, slots)
        keys.append(k)
        values.append(v)
    return cache, torch.stack(tables), keys, values


def _trainer_attention(queries, keys, values, scale):
    """What the trainer computes for these sequences: one left-padded batch, causal + padding mask,
    through the canonical kernel; per sequence ``[T, H, D]``."""
    lengths = [len(x) for x in queries]
    (heads, dim), kv_heads, dtype = queries[0].shape[1:], keys[0].shape[1], queries[0].dtype
    width = max(lengths)
    q = torch.zeros(len(lengths), heads, width, dim, dtype=dtype)
    k = torch.zeros(len(lengths), kv_heads, width, dim, dtype=dtype)
    v = torch.zeros_like(k)
    real = torch.zeros(len(lengths), width, dtype=torch.bool)
    for i, n in enumerate(lengths):
        q[i, :, width - n :] = queries[i].transpose(0, 1)
        k[i, :, width - n :] = keys[i].transpose(0, 1)
        v[i, :, width - n :] = values[i].transpose(0, 1)
        real[i, width - n :] = True
    visible = (torch.ones(width, width, dtype=torch.bool).tril()[None] & real[:, None, :])[:, None]
    full = canonical_attention.attention(q, k, v, visible, scale)  # [B, T, H, D]
    return [full[i, width - n :] for i, n in enumerate(lengths)]


def _vllm_step(caches, tables, queries, query_counts, scale):
    """One vLLM step over one or more layers (``caches``, one metadata object for all, as vLLM
    passes it): request i computes its last ``query_counts[i]`` tokens; per layer, per request."""
    from skyrl_isoexec.vllm.attention import IsoExecAttentionMetadata, attend

    lengths = [len(x) for x in queries]
    starts = torch.tensor([0, *torch.tensor(query_counts).cumsum(0).tolist()])
    query = torch.cat([queries[i][n - c :] for i, (n, c) in enumerate(zip(lengths, query_counts))])
    meta = IsoExecAttentionMetadata(
        num_actual_tokens=int(starts[-1]), num_reqs=len(lengths), max_query_len=max(query_counts),
        max_seq_len=max(lengths), query_start_loc=starts, seq_lens=torch.tensor(lengths),
        block_table=tables, slot_mapping=torch.zeros(0, dtype=torch.long),
    )
    layers = []
    for cache in caches:
        out = torch.full((len(query) + 3, *query.shape[1:]), float("nan"), dtype=query.dtype)  # vLLM pads
        attend(query, cache, meta, scale, out)
        layers.append([out[starts[i] : starts[i + 1]] for i in range(len(lengths))])
    return layers


# (heads, kv_heads, head dim, block size, lengths): 3 query rows per kv head (SmolLM2's 9/3 heads,
# padded to 8 rows) with vLLM-CPU's 128-slot blocks, and requests spanning several blocks and 3
# key blocks (the combine's power-of-two padding).
SHAPES = [(4, 2, 32, 32, [5, 70, 33]), (9, 3, 64, 128, [40, 39, 72, 1]), (8, 2, 32, 16, [150, 7, 129])]


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s[0]}h{s[1]}kv-block{s[3]}")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_paged_attention_matches_the_trainers_padded_full_forward(dtype, shape):
    heads, kv_heads, dim, block_size, lengths = shape
    scale = dim**-0.5
    cache, tables, keys, values = _paged(lengths, kv_heads, dim, block_size, dtype, seed=0)
    queries = [torch.randn(n, heads, dim, generator=_gen(40 + i)).to(dtype) for i, n in enumerate(lengths)]
    want = _trainer_attention(queries, keys, values, scale)

    def step(query_counts):
        return _vllm_step([cache], tables, queries, query_counts, scale)[0]

    prefill = step(lengths)  # every token at once
    decode = step([1] * len(lengths))  # the last token of each, as a decode step
    chunk = step([min(n, c) for n, c in zip(lengths, (2, 17, 1, 1))])  # chunked prefill / cached prefix
    for i, n in enumerate(lengths):
        assert int((bits(prefill[i]) != bits(want[i])).sum()) == 0
        assert int((bits(decode[i]) != bits(want[i][-1:])).sum()) == 0
        assert int((bits(chunk[i]) != bits(want[i][-len(chunk[i]) :])).sum()) == 0
    # Negative control: plain SDPA over each sequence alone differs from the trainer's bits.
    sdpa = [
        F.scaled_dot_product_attention(
            queries[i].transpose(0, 1)[None], keys[i].transpose(0, 1)[None], values[i].transpose(0, 1)[None],
            is_causal=True, scale=scale, enable_gqa=True,
        )[0].transpose(0, 1)
        for i in range(len(lengths))
    ]
    assert sum(int((bits(s) != bits(w)).sum()) for s, w in zip(sdpa, want)) > 0


def test_paged_attention_layers_of_a_step_share_its_plan_not_their_caches():
    # vLLM passes one metadata object to every layer of a step; the index work IsoExec derives from
    # it is done once, but each layer reads its own cache.
    heads, kv_heads, dim, block_size, lengths = SHAPES[1]
    scale = dim**-0.5
    first, tables, keys1, values1 = _paged(lengths, kv_heads, dim, block_size, torch.float32, seed=0)
    second, _, keys2, values2 = _paged(lengths, kv_heads, dim, block_size, torch.float32, seed=0, kv_seed=7)
    queries = [torch.randn(n, heads, dim, generator=_gen(40 + i)) for i, n in enumerate(lengths)]
    for counts in ([1] * len(lengths), lengths):
        got1, got2 = _vllm_step([first, second], tables, queries, counts, scale)
        for got, keys, values in ((got1, keys1, values1), (got2, keys2, values2)):
            want = _trainer_attention(queries, keys, values, scale)
            assert sum(int((bits(g) != bits(w[-len(g) :])).sum()) for g, w in zip(got, want)) == 0
        assert sum(int((bits(a) != bits(b)).sum()) for a, b in zip(got1, got2)) > 0  # the caches do differ
