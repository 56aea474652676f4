"""Per-op site parity: each canonical kernel gives a row (token) the same bits whether it is computed
in a large batch, alone, at another position, after padding, as a decode step or with 1 or 2
threads. Where the stock op really varies on this machine, a negative control shows it."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from skyrl_isoexec.kernels import attention as attention_kernel
from skyrl_isoexec.kernels import elementwise, gdn, linear, logprobs, moe
from skyrl_isoexec.kernels.reduce import sigmoid, silu, softplus, tree_sum
from skyrl_isoexec.parity import bits


def _gen(seed=0):
    return torch.Generator().manual_seed(seed)


CASES = ((1, 0), (1, 37), (3, 5), (9, 20), (33, 2), (20, 20))


def _row_mismatch(fn, x, cases=CASES):
    """Bits of fn(x[o:o+m]) vs fn(x)[o:o+m] over row slices, summed."""
    ref = fn(x)
    return sum(int((bits(fn(x[o : o + m])) != bits(ref[o : o + m])).sum()) for m, o in cases)


def _sliced_mismatch(fn, rows, cases=CASES):
    """Like ``_row_mismatch`` for a function of a row slice (to slice several inputs alike)."""
    ref = fn(slice(0, rows))
    return sum(int((bits(fn(slice(o, o + m))) != bits(ref[o : o + m])).sum()) for m, o in cases)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(64, 128), (64, 1), (512, 2048), (2048, 64)])
def test_linear_rows_are_independent_of_their_batch(dtype, shape):
    k, n = shape
    x = torch.randn(60, k, generator=_gen()).to(dtype)
    w = torch.randn(n, k, generator=_gen(1)).to(dtype)
    for threads in (1, 2):
        torch.set_num_threads(threads)
        assert _row_mismatch(lambda t: linear.linear(t, w), x) == 0
    torch.set_num_threads(1)
    one = linear.linear(x, w)
    torch.set_num_threads(2)
    assert int((bits(one) != bits(linear.linear(x, w))).sum()) == 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_linear_negative_control_and_the_multiple_of_8_property(dtype):
    x = torch.randn(1024, 512, generator=_gen()).to(dtype)
    w = torch.randn(256, 512, generator=_gen(1)).to(dtype)
    if dtype == torch.float32:
        assert _row_mismatch(lambda t: F.linear(t, w), x[:60]) > 0  # stock rows depend on the batch
    # What the kernel relies on: its GEMM (oneDNN for fp32, torch.mm for bf16) over any multiple of
    # 8 rows gives each row the bits of an 8-row GEMM, with 1 or 2 threads.
    for threads in (1, 2):
        torch.set_num_threads(threads)
        for rows, offset in ((8, 0), (16, 8), (40, 200), (256, 16), (1024, 0)):
            whole = linear._gemm(x[offset : offset + rows], w)
            blocks = torch.cat([linear._gemm(x[offset + i : offset + i + 8], w) for i in range(0, rows, 8)])
            assert int((bits(whole) != bits(blocks)).sum()) == 0, (threads, rows)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_linear_columns_are_independent_of_the_other_columns(dtype):
    # What lets an engine run q/k/v (or gate/up) as one GEMM on the concatenated weight while the
    # trainer runs three: each output column gets the bits of its own weight row alone, for any
    # widths (SmolLM2's and Qwen3's shapes among them), with 1 or 2 threads.
    before = torch.get_num_threads()
    for threads in (1, 2):
        torch.set_num_threads(threads)
        for k, widths in ((576, (576, 192, 192)), (576, (1536, 1536)), (1024, (2048, 256, 256)), (64, (48, 16, 100))):
            parts = [torch.randn(n, k, generator=_gen(n)).to(dtype) for n in widths]
            fused_weight = torch.cat(parts)
            for rows in (1, 16, 72):
                x = torch.randn(rows, k, generator=_gen(rows)).to(dtype)
                fused = linear.linear(x, fused_weight)
                separate = torch.cat([linear.linear(x, w) for w in parts], dim=1)
                assert int((bits(fused) != bits(separate)).sum()) == 0, (threads, k, widths, rows)
    torch.set_num_threads(before)


def test_linear_gradient_is_the_ordinary_one():
    x = torch.randn(10, 32, generator=_gen(), requires_grad=True)
    w = torch.randn(16, 32, generator=_gen(1), requires_grad=True)
    b = torch.randn(16, generator=_gen(2), requires_grad=True)
    g = torch.randn(10, 16, generator=_gen(3))
    grads = torch.autograd.grad((linear.linear(x, w, b) * g).sum(), (x, w, b))
    expected = torch.autograd.grad((F.linear(x, w, b) * g).sum(), (x, w, b))
    for got, want in zip(grads, expected):
        torch.testing.assert_close(got, want)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("width", [64, 96, 576, 2048])
def test_rms_norm_and_silu_mul_rows(dtype, width):
    x = torch.randn(60, width, generator=_gen()).to(dtype)
    w = (torch.randn(width, generator=_gen(1)) * 0.1 + 1).to(dtype)
    g = torch.randn(60, width, generator=_gen(2)).to(dtype)
    before = torch.get_num_threads()
    for threads in (1, 2):
        torch.set_num_threads(threads)
        assert _row_mismatch(lambda t: elementwise.rms_norm(t, w, 1e-6), x) == 0
        assert _row_mismatch(lambda t: elementwise.rms_norm(t, w, 1e-6, unit_offset=True), x) == 0
    torch.set_num_threads(1)
    one = elementwise.rms_norm(x, w, 1e-6)
    torch.set_num_threads(2)
    assert int((bits(one) != bits(elementwise.rms_norm(x, w, 1e-6))).sum()) == 0
    torch.set_num_threads(before)
    assert _sliced_mismatch(lambda s: elementwise.rms_norm(x[s], w, 1e-6, gate=g[s]), 60) == 0
    assert _sliced_mismatch(lambda s: elementwise.silu_mul(g[s], x[s]), 60) == 0
    # Without autograd the kernels compute in place on their intermediates: the autograd path's bits.
    for unit_offset in (False, True):
        tracked = elementwise.rms_norm(x.clone().requires_grad_(), w, 1e-6, unit_offset=unit_offset).detach()
        assert int((bits(tracked) != bits(elementwise.rms_norm(x, w, 1e-6, unit_offset=unit_offset))).sum()) == 0
    tracked = elementwise.silu_mul(g.clone().requires_grad_(), x).detach()
    assert int((bits(tracked) != bits(elementwise.silu_mul(g, x))).sum()) == 0
    big = torch.randn(1280, width, generator=_gen(3)).to(dtype)  # a training batch's rows, 2 threads
    torch.set_num_threads(2)
    whole = elementwise.rms_norm(big, w, 1e-6)
    torch.set_num_threads(1)
    assert int((bits(whole[40:52]) != bits(elementwise.rms_norm(big[40:52], w, 1e-6))).sum()) == 0
    torch.set_num_threads(before)


def test_elementwise_gates_are_layout_independent_where_stock_is_not():
    x = torch.randn(4099, generator=_gen()) * 6
    for fn in (silu, sigmoid, softplus):
        full = fn(x)
        assert sum(int((bits(fn(x[s : s + 37])) != bits(full[s : s + 37])).sum()) for s in range(0, 64, 3)) == 0
    stock = [F.silu, torch.sigmoid, F.softplus]  # vectorised bodies and scalar tails round differently
    assert all(
        sum(int((bits(fn(x[s : s + 37])) != bits(fn(x)[s : s + 37])).sum()) for s in range(0, 64, 3)) > 0 for fn in stock
    )


def test_tree_sum_ignores_trailing_zeros_and_thread_count():
    x = torch.randn(7, 300, generator=_gen())
    padded = F.pad(x, (0, 724))
    assert int((bits(tree_sum(x)) != bits(tree_sum(padded))).sum()) == 0
    big = torch.randn(2, 70000, generator=_gen(1))
    torch.set_num_threads(2)
    two = tree_sum(big)
    torch.set_num_threads(1)
    assert int((bits(two) != bits(tree_sum(big))).sum()) == 0


def test_tree_sum_gradient_and_grad_mode_forward():
    x = torch.randn(3, 5, 300, generator=_gen(), requires_grad=True)
    g = torch.randn(3, 300, generator=_gen(1))
    for dim in (-1, 1):
        out = tree_sum(x, dim=dim)
        with torch.no_grad():
            assert int((bits(out) != bits(tree_sum(x, dim=dim))).sum()) == 0
        weights = g if dim == 1 else g[:, :5]
        (grad,) = torch.autograd.grad((out * weights).sum(), x)
        (want,) = torch.autograd.grad((x.sum(dim) * weights).sum(), x)
        assert torch.equal(grad, want)


def test_logprobs_and_rms_norm_gradients_are_the_ordinary_ones():
    logits = (torch.randn(20, 1000, generator=_gen()) * 3).requires_grad_()
    ids = torch.randint(0, 1000, (20,), generator=_gen(1))
    g = torch.randn(20, generator=_gen(2))
    got = torch.autograd.grad((logprobs.logprobs(logits, ids, 0.7) * g).sum(), logits)[0]
    want = torch.autograd.grad((torch.log_softmax(logits / 0.7, -1).gather(-1, ids[:, None])[:, 0] * g).sum(), logits)[0]
    torch.testing.assert_close(got, want)
    x = torch.randn(20, 96, generator=_gen(3), requires_grad=True)
    w = (torch.randn(96, generator=_gen(4)) * 0.1 + 1).requires_grad_()
    gy = torch.randn(20, 96, generator=_gen(5))
    got = torch.autograd.grad((elementwise.rms_norm(x, w, 1e-6) * gy).sum(), (x, w))
    want = torch.autograd.grad((w * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * gy).sum(), (x, w))
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b)


def test_rope_table_entries_do_not_depend_on_table_size():
    inv_freq = 1.0 / (10000 ** (torch.arange(0, 32, 2).float() / 32))
    elementwise._rope_tables.clear()
    late = elementwise.rope(inv_freq, 1.0, torch.tensor([[700]]), torch.float32)  # small table first
    batch = elementwise.rope(inv_freq, 1.0, torch.arange(1000)[None], torch.float32)  # grown table
    assert all(int((bits(a[0, 0]) != bits(b[0, 700])).sum()) == 0 for a, b in zip(late, batch))


def _attention_inputs(dtype, batch=3, heads=4, kv_heads=2, steps=40, dim=32):
    g = _gen()
    q = torch.randn(batch, heads, steps, dim, generator=g).to(dtype)
    k = torch.randn(batch, kv_heads, steps, dim, generator=g).to(dtype)
    v = torch.randn(batch, kv_heads, steps, dim, generator=g).to(dtype)
    return q, k, v


def _causal(batch, tq, tk, pads=None):
    visible = torch.ones(tq, tk, dtype=torch.bool).tril(tk - tq)[None].repeat(batch, 1, 1)
    for b, p in enumerate(pads or []):
        visible[b, :, :p] = False
    return visible[:, None]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_attention_prefill_equals_decode_with_padding_and_longer_caches(dtype):
    q, k, v = _attention_inputs(dtype)
    pads = [0, 5, 13]
    full = attention_kernel.attention(q, k, v, _causal(3, 40, 40, pads), 0.17)  # [B, T, H, D]
    for b, pad in enumerate(pads):
        for t in (pad, pad + 1, 20, 39):
            # One decode step of sequence b, alone, with the cache starting at its first real token
            # and with 11 never-visible slots after it (a longer cache).
            kk = F.pad(k[b : b + 1, :, pad : t + 1], (0, 0, 0, 11))
            vv = F.pad(v[b : b + 1, :, pad : t + 1], (0, 0, 0, 11))
            visible = torch.zeros(1, 1, 1, kk.shape[2], dtype=torch.bool)
            visible[..., : t + 1 - pad] = True
            step = attention_kernel.attention(q[b : b + 1, :, t : t + 1], kk, vv, visible, 0.17)
            assert int((bits(step[0, 0]) != bits(full[b, t])).sum()) == 0, (b, t)


def _attention_as_specified(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, visible: torch.Tensor, scaling: float
) -> torch.Tensor:
    """Canonical attention exactly as its spec (version 3) states it, in its plainest form: every
    key slot up to a power-of-two number of blocks computed, masked scores at -inf. The kernel must
    give these bits."""
    batch, heads, tq, dim = query.shape
    kv_heads, tk = key.shape[1], key.shape[2]
    if heads % kv_heads:
        raise ValueError(f"canonical attention: {heads} query heads are not a multiple of {kv_heads} kv heads")
    rep = heads // kv_heads
    visible = attention_kernel._as_visible(visible)
    if visible.shape[1] != 1:
        visible = visible[:, :1]  # per-head masks are identical for causal/padding masks
    visible = visible.expand(batch, 1, tq, tk)[:, 0]  # [B, Tq, Tk]

    # Re-index keys so that key 0 is the first key the last query sees.
    start = torch.where(visible[:, -1].any(-1), visible[:, -1].float().argmax(-1), 0)  # [B]
    counts = visible.sum(-1)  # [B, Tq]
    if bool((start > 0).any()):
        index = (torch.arange(tk, device=key.device)[None, :] + start[:, None]).clamp(max=tk - 1)  # [B, Tk]
        gather = index[:, None, :, None].expand(batch, kv_heads, tk, dim)
        key = key.gather(2, gather)
        value = value.gather(2, gather)
        visible = visible.gather(2, index[:, None, :].expand(batch, tq, tk)) & (
            torch.arange(tk, device=key.device)[None, None, :] < (tk - start)[:, None, None]
        )
    prefix = torch.arange(tk, device=key.device)[None, None, :] < counts[..., None]
    if not bool((prefix == visible).all()):
        raise ValueError(
            "canonical attention needs every query to see a contiguous run of keys starting at its sequence start "
            "(causal attention with padding or a KV cache); got another mask"
        )

    kv_blocks = attention_kernel.next_power_of_two(-(-tk // attention_kernel.KEY_BLOCK))
    slots = kv_blocks * attention_kernel.KEY_BLOCK
    # Query rows per kv head: [B*Hkv, rows, D], rows padded to a multiple of attention_kernel.ROW_ALIGN.
    rows = rep * tq
    padded_rows = -(-rows // attention_kernel.ROW_ALIGN) * attention_kernel.ROW_ALIGN
    q = attention_kernel._pad_dim(query.float().reshape(batch * kv_heads, rows, dim), 1, padded_rows)
    k = attention_kernel._pad_dim(key.float().reshape(batch * kv_heads, tk, dim), 1, slots)
    v = attention_kernel._pad_dim(value.float().reshape(batch * kv_heads, tk, dim), 1, slots)

    # Scores: one GEMM per kv head, [rows, D] @ [D, slots]; rows a multiple of 8, slots of 64.
    scores = torch.bmm(q, k.transpose(1, 2)).view(batch, kv_heads, padded_rows, slots) * scaling

    # Visible slots per row: rows are (rep, Tq) flattened; counts are per (B, Tq).
    row_counts = counts[:, None, :].expand(batch, rep, tq).reshape(batch, 1, rows)
    row_counts = attention_kernel._pad_dim(row_counts, 2, padded_rows)
    seen = torch.arange(slots, device=scores.device)[None, None, None, :] < row_counts[..., None]
    scores = scores.masked_fill(~seen, float("-inf"))
    weights = torch.softmax(scores, -1)
    weights = torch.where(seen.any(-1, keepdim=True), weights, 0.0)  # rows that see nothing: zeros

    # Weighted values: one GEMM per key block, [rows, attention_kernel.KEY_BLOCK] @ [attention_kernel.KEY_BLOCK, D], block partials
    # combined by a halving tree.
    blocks = weights.view(batch * kv_heads, padded_rows, kv_blocks, attention_kernel.KEY_BLOCK).transpose(1, 2)
    partial = torch.bmm(
        blocks.reshape(-1, padded_rows, attention_kernel.KEY_BLOCK), v.view(batch * kv_heads * kv_blocks, attention_kernel.KEY_BLOCK, dim)
    ).view(batch * kv_heads, kv_blocks, padded_rows, dim)
    out = tree_sum(partial, dim=1)[:, :rows]  # [B*Hkv, rows, D]
    out = out.reshape(batch, heads, tq, dim).transpose(1, 2)
    return out.to(query.dtype).contiguous()

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_attention_kernel_gives_the_bits_of_its_plain_specification(dtype):
    # The kernel skips work the definition does (key blocks past the last key, exp of hidden
    # slots); on every shape it must still give the definition's bits, dead rows included.
    before = torch.get_num_threads()
    g = _gen(11)
    for threads in (1, 2):
        torch.set_num_threads(threads)
        for heads, kv_heads in ((4, 2), (3, 3), (8, 2)):
            for tk in (1, 7, 64, 65, 130, 200, 257):
                k = torch.randn(2, kv_heads, tk, 32, generator=g).to(dtype)
                v = torch.randn(2, kv_heads, tk, 32, generator=g).to(dtype)
                for tq, pads in ((tk, [0, min(5, tk - 1)]), (1, [0, 0]), (3, [0, min(2, tk - 1)])):
                    if tq > tk:
                        continue
                    q = (torch.randn(2, heads, tq, 32, generator=g) * 3).to(dtype)
                    visible = _causal(2, tq, tk, pads)
                    got = attention_kernel.attention(q, k, v, visible, 0.2)
                    want = _attention_as_specified(q, k, v, visible, 0.2)
                    assert int((bits(got) != bits(want)).sum()) == 0, (threads, heads, kv_heads, tk, tq)
    torch.set_num_threads(before)


def _reference_attention(q, k, v, visible, scaling):
    """Plain masked softmax attention with repeated kv heads, fp32 (rows that see nothing: zeros)."""
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    scores = (q @ k.transpose(-1, -2) * scaling).masked_fill(~visible, float("-inf"))
    return (torch.softmax(scores, -1).nan_to_num(0.0) @ v).transpose(1, 2)


def test_attention_gradient_is_the_ordinary_one_and_grad_mode_keeps_the_forward_bits():
    q, k, v = (t.requires_grad_() for t in _attention_inputs(torch.float32))
    visible = _causal(3, 40, 40, [0, 5, 13])  # padded rows of sequences 1 and 2 see nothing
    g = torch.randn(3, 40, 4, 32, generator=_gen(7))
    out = attention_kernel.attention(q, k, v, visible, 0.17)
    with torch.no_grad():
        assert int((bits(out) != bits(attention_kernel.attention(q, k, v, visible, 0.17))).sum()) == 0
    got = torch.autograd.grad((out * g).sum(), (q, k, v))
    want = torch.autograd.grad((_reference_attention(q, k, v, visible, 0.17) * g).sum(), (q, k, v))
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    assert float(got[0][2, :, :13].abs().max()) == 0.0  # queries that see nothing get no gradient


def test_score_gemm_property_the_attention_relies_on():
    """[rows, D] @ [D, slots] with rows a multiple of 4 (the kernel's QUERY_ROW_PAD) and slots of 64
    gives every (row, key) the bits of an 8 x 64 GEMM, for any batch count and 1 or 2 threads; so
    does the values product [rows, 64] @ [64, D]. Fewer than 4 rows would not (control)."""
    g = _gen()
    before = torch.get_num_threads()
    assert attention_kernel.QUERY_ROW_PAD == 4
    for dim in (64, 128):
        q, k = torch.randn(5, 64, dim, generator=g), torch.randn(5, dim, 512, generator=g)
        w, v = torch.rand(5, 64, 64, generator=g), torch.randn(5, 64, dim, generator=g)
        for threads in (1, 2):
            torch.set_num_threads(threads)
            tiles = torch.cat([torch.bmm(q[:, :8], k[:, :, j : j + 64]) for j in range(0, 512, 64)], dim=-1)
            tiles_v = torch.bmm(w[:, :8], v)
            for rows, slots, batch in ((4, 64, 1), (8, 64, 1), (12, 128, 5), (16, 128, 5), (64, 512, 5), (24, 192, 2)):
                whole = torch.bmm(q[:batch, :rows], k[:batch, :, :slots])[:, : min(rows, 8)]
                want = tiles[:batch, : min(rows, 8), :slots]
                assert int((bits(whole) != bits(want)).sum()) == 0, (threads, rows, slots, batch)
                whole_v = torch.bmm(w[:batch, :rows], v[:batch])[:, : min(rows, 8)]
                assert int((bits(whole_v) != bits(tiles_v[:batch, : min(rows, 8)])).sum()) == 0, (threads, rows)
            three = torch.bmm(q[:, :3], k[:, :, :64])
            assert int((bits(three) != bits(tiles[:, :3, :64])).sum()) > 0  # why rows are padded at all
    torch.set_num_threads(before)


def test_softmax_property_the_attention_relies_on():
    # torch's softmax computes a row alone, and whole 64-slot blocks of -inf appended to a row
    # (keys a query cannot see, a longer cache) leave its bits unchanged, with 1 or 2 threads.
    before = torch.get_num_threads()
    g = _gen(5)
    for threads in (1, 2):
        torch.set_num_threads(threads)
        for visible in (1, 50, 64, 100, 200):
            base_slots = -(-visible // 64) * 64
            x = torch.randn(48, 8, base_slots, generator=g) * 4
            x[..., visible:] = float("-inf")
            base = torch.softmax(x, -1)
            for extra in (64, 128, 448):
                longer = torch.cat([x, torch.full((48, 8, extra), float("-inf"))], -1)
                assert int((bits(torch.softmax(longer, -1)[..., :base_slots]) != bits(base)).sum()) == 0
            assert int((bits(torch.softmax(x[5:9], -1)) != bits(base[5:9])).sum()) == 0
    torch.set_num_threads(before)


def test_attention_threads_and_negative_control():
    q, k, v = _attention_inputs(torch.float32, batch=1, steps=70)
    visible = _causal(1, 70, 70)
    torch.set_num_threads(2)
    two = attention_kernel.attention(q, k, v, visible, 0.17)
    torch.set_num_threads(1)
    assert int((bits(two) != bits(attention_kernel.attention(q, k, v, visible, 0.17))).sum()) == 0
    # Stock: the same query as a decode step differs from the full-sequence computation.
    kk, vv = k.repeat_interleave(2, 1), v.repeat_interleave(2, 1)
    full = F.scaled_dot_product_attention(q, kk, vv, is_causal=True, scale=0.17)
    steps = torch.cat([F.scaled_dot_product_attention(q[:, :, t : t + 1], kk[:, :, : t + 1], vv[:, :, : t + 1], scale=0.17)
                       for t in range(70)], dim=2)
    assert int((bits(full) != bits(steps)).sum()) > 0


def test_attention_refuses_a_non_prefix_mask():
    q, k, v = _attention_inputs(torch.float32, batch=1, steps=8)
    visible = _causal(1, 8, 8)
    visible[..., 3, 1] = False  # a hole
    with pytest.raises(ValueError, match="contiguous run of keys"):
        attention_kernel.attention(q, k, v, visible, 0.17)


@pytest.mark.parametrize("vocab", [1000, 4096, 49152, 151936])
def test_logprobs_rows_and_temperature(vocab):
    # What the kernel relies on: torch's log-softmax computes each row alone, so a row's bits do
    # not depend on the rows around it or on the thread count (vocabularies of SmolLM2 and Qwen).
    logits = torch.randn(50, vocab, generator=_gen()) * 3
    ids = torch.randint(0, vocab, (50,), generator=_gen(1))
    before = torch.get_num_threads()
    per_thread = []
    for threads in (1, 2):
        torch.set_num_threads(threads)
        assert _sliced_mismatch(lambda s: logprobs.logprobs(logits[s], ids[s]), 50) == 0
        per_thread.append(logprobs.logprobs(logits, ids))
    torch.set_num_threads(before)
    assert int((bits(per_thread[0]) != bits(per_thread[1])).sum()) == 0
    full = logprobs.full_log_softmax(logits)
    assert int((bits(full.gather(-1, ids[:, None])[:, 0]) != bits(per_thread[0])).sum()) == 0
    scaled = logprobs.logprobs(logits, ids, 0.7)
    # fp32 against fp64: the error grows with the vocabulary's sum (3.2e-5 on logprobs of about -9 at
    # 152k entries on an AVX2-only CPU, whose shorter vectors sum in another order); a wrong
    # temperature moves them by whole nats.
    reference = torch.log_softmax(logits.double() / 0.7, -1).gather(-1, ids[:, None])[:, 0].float()
    torch.testing.assert_close(scaled, reference, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_moe_token_results_do_not_depend_on_the_other_tokens(dtype):
    g = _gen()
    x = torch.randn(40, 64, generator=g).to(dtype)
    router_w = torch.randn(8, 64, generator=g).to(dtype)
    gate_up = (torch.randn(8, 64, 64, generator=g) * 0.1).to(dtype)
    down = (torch.randn(8, 64, 32, generator=g) * 0.1).to(dtype)

    def block(t):
        w, chosen = moe.router(t, router_w, 2, True)
        return moe.combine(moe.experts(t, chosen, gate_up, down), w)

    assert _row_mismatch(block, x) == 0


def test_moe_negative_control_stock_experts_depend_on_the_batch():
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    torch.manual_seed(0)
    config = Qwen3MoeConfig(hidden_size=256, moe_intermediate_size=512, num_experts=8, num_experts_per_tok=2)
    block = Qwen3MoeSparseMoeBlock(config)
    for p in block.parameters():
        torch.nn.init.normal_(p, std=0.05)
    x = torch.randn(1, 60, 256, generator=_gen())
    with torch.no_grad():
        assert _row_mismatch(lambda t: block(t[None])[0], x[0]) > 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gdn_prefill_equals_decode_and_any_split(dtype):
    g = _gen()
    B, T, C, W = 2, 23, 96, 4
    x = torch.randn(B, T, C, generator=g).to(dtype)
    taps = torch.randn(C, W, generator=g).to(dtype)
    q = torch.randn(B, T, 2, 16, generator=g).to(dtype)
    k = torch.randn(B, T, 2, 16, generator=g).to(dtype)
    v = torch.randn(B, T, 4, 16, generator=g).to(dtype)
    a = torch.randn(B, T, 4, generator=g).to(dtype)
    b = torch.randn(B, T, 4, generator=g).to(dtype)
    A_log, dt_bias = torch.randn(4, generator=g), torch.randn(4, generator=g).to(dtype)
    full_conv, _ = gdn.conv(x, taps, None, None)
    full_core, full_state = gdn.core(q, k, v, a, b, A_log, dt_bias, None)
    for split in (1, 7, 22):
        c1, s1 = gdn.conv(x[:, :split], taps, None, None)
        c2, _ = gdn.conv(x[:, split:], taps, None, s1)
        assert int((bits(torch.cat((c1, c2), 1)) != bits(full_conv)).sum()) == 0
        o1, r1 = gdn.core(q[:, :split], k[:, :split], v[:, :split], a[:, :split], b[:, :split], A_log, dt_bias, None)
        o2, r2 = gdn.core(q[:, split:], k[:, split:], v[:, split:], a[:, split:], b[:, split:], A_log, dt_bias, r1)
        assert int((bits(torch.cat((o1, o2), 1)) != bits(full_core)).sum()) == 0
        assert int((bits(r2) != bits(full_state)).sum()) == 0
    # Batch invariance: sequence 1 alone.
    alone, _ = gdn.core(q[1:], k[1:], v[1:], a[1:], b[1:], A_log, dt_bias, None)
    assert int((bits(alone) != bits(full_core[1:])).sum()) == 0


def test_gdn_negative_control_chunked_vs_recurrent():
    from transformers.models.qwen3_next.modeling_qwen3_next import (
        torch_chunk_gated_delta_rule,
        torch_recurrent_gated_delta_rule,
    )

    g = _gen()
    q, k, v = (torch.randn(1, 70, 2, 16, generator=g) for _ in range(3))
    decay = -torch.rand(1, 70, 2, generator=g)
    beta = torch.rand(1, 70, 2, generator=g)
    chunked, _ = torch_chunk_gated_delta_rule(q, k, v, g=decay, beta=beta, use_qk_l2norm_in_kernel=True)
    recurrent, _ = torch_recurrent_gated_delta_rule(q, k, v, g=decay, beta=beta, use_qk_l2norm_in_kernel=True)
    assert int((bits(chunked) != bits(recurrent)).sum()) > 0


def test_kernel_caches_filled_in_inference_mode_serve_autograd():
    # An engine (inference mode) and a trainer (autograd) share one process in tests and benchmarks.
    x = torch.randn(4, 40, generator=_gen())
    elementwise._ones.clear()
    with torch.inference_mode():
        elementwise.rms_norm(x.clone(), torch.ones(40), 1e-6)
    x.requires_grad_()
    elementwise.rms_norm(x, torch.ones(40), 1e-6).sum().backward()
    assert x.grad is not None and bool(torch.isfinite(x.grad).all())


def test_attention_reuses_a_masks_plan_only_while_the_mask_is_unchanged():
    q, k, v = _attention_inputs(torch.float32, batch=2, steps=20)
    visible = _causal(2, 20, 20, [0, 3])
    first = attention_kernel.attention(q, k, v, visible, 0.3)
    plan = attention_kernel._last_plan[0][3]
    again = attention_kernel.attention(q, k, v, visible, 0.3)  # same mask object: same plan
    assert attention_kernel._last_plan[0][3] is plan
    assert int((bits(first) != bits(again)).sum()) == 0
    visible[1, :, :, 3:6] = False  # modified in place: a new plan, and the new mask's result
    visible[1, :, :3] = False
    visible[1, :, :, :6] = False
    changed = attention_kernel.attention(q, k, v, visible, 0.3)
    assert attention_kernel._last_plan[0][3] is not plan
    fresh = attention_kernel.attention(q, k, v, visible.clone(), 0.3)
    assert int((bits(changed) != bits(fresh)).sum()) == 0
    assert int((bits(changed[1]) != bits(first[1])).sum()) > 0
