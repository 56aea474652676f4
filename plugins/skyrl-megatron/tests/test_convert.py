"""HF <-> Megatron weight conversion: layout of the fused tensors, and a bit-exact round trip."""

import pytest
import torch

from skyrl_core.config.schema import ModelConfig
from skyrl_core.models import build_hf_config, load_causal_lm
from skyrl_core.testing.backend_contract import assert_weights_bitwise_equal, bits
from skyrl_megatron.convert import expert_name, hf_to_megatron, megatron_to_hf
from skyrl_megatron.layout import layout_from_hf_config

from megatron_test_models import DENSE_QWEN3_NEXT, TINY_LLAMA, TINY_QWEN3, TINY_QWEN3_MOE, TINY_QWEN3_NEXT

# Vocabulary 510 is not divisible by 4: the shards are padded with zero rows.
ODD_VOCAB_QWEN3 = {**TINY_QWEN3, "vocab_size": 510, "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 16}


def hf_state(config: dict) -> tuple[dict[str, torch.Tensor], object]:
    model = load_causal_lm(ModelConfig(config=dict(config)), seed=0)
    return dict(model.state_dict()), layout_from_hf_config(model.config)


@pytest.mark.parametrize(
    ("config", "tp"),
    [
        (TINY_QWEN3, 1), (TINY_QWEN3, 2), (TINY_LLAMA, 1), (TINY_LLAMA, 2),
        (ODD_VOCAB_QWEN3, 2), (ODD_VOCAB_QWEN3, 4), (TINY_QWEN3_MOE, 1), (TINY_QWEN3_MOE, 2),
        (TINY_QWEN3_NEXT, 1), (TINY_QWEN3_NEXT, 2), (DENSE_QWEN3_NEXT, 2),
    ],
    ids=[
        "qwen3-tied-tp1", "qwen3-tied-tp2", "llama-untied-tp1", "llama-untied-tp2",
        "qwen3-vocab510-tp2", "qwen3-vocab510-tp4", "qwen3-moe-tp1", "qwen3-moe-tp2",
        "qwen3-next-tp1", "qwen3-next-tp2", "qwen3-next-dense-mlp-tp2",
    ],
)
def test_round_trip_is_bit_exact(config, tp):
    hf, layout = hf_state(config)
    shards = [hf_to_megatron(hf, layout, tp_rank=r, tp_size=tp) for r in range(tp)]
    back = megatron_to_hf(shards, layout)
    assert_weights_bitwise_equal(back, hf)


def test_round_trip_comparison_sees_one_ulp():
    # Negative control for the test above: a one-ulp change in one shard survives the round trip.
    hf, layout = hf_state(TINY_LLAMA)
    shards = [hf_to_megatron(hf, layout, tp_rank=r, tp_size=2) for r in range(2)]
    shards[1]["decoder.layers.0.self_attention.linear_qkv.weight"].view(torch.int32)[5, 7] += 1
    back = megatron_to_hf(shards, layout)
    with pytest.raises(AssertionError, match="k_proj|q_proj|v_proj"):
        assert_weights_bitwise_equal(back, hf)


def test_fused_qkv_groups_queries_with_their_key_and_value():
    hf, layout = hf_state(TINY_QWEN3)  # 4 query heads, 2 kv groups, head_dim 32
    hd = layout.head_dim
    q, k, v = (hf[f"model.layers.0.self_attn.{n}_proj.weight"] for n in "qkv")
    for tp in (1, 2):
        for rank in range(tp):
            qkv = hf_to_megatron(hf, layout, tp_rank=rank, tp_size=tp)["decoder.layers.0.self_attention.linear_qkv.weight"]
            groups = layout.num_kv_heads // tp
            assert qkv.shape == (groups * (layout.heads_per_group + 2) * hd, layout.hidden_size)
            for local in range(groups):
                g = rank * groups + local
                block = qkv[local * 4 * hd : (local + 1) * 4 * hd]
                # query heads 2g and 2g+1 use kv head g (transformers' repeat_kv order)
                assert torch.equal(block[: 2 * hd], q[2 * g * hd : (2 * g + 2) * hd])
                assert torch.equal(block[2 * hd : 3 * hd], k[g * hd : (g + 1) * hd])
                assert torch.equal(block[3 * hd :], v[g * hd : (g + 1) * hd])


def test_fc1_holds_the_ranks_gate_rows_then_up_rows_and_vocab_is_padded():
    hf, layout = hf_state(ODD_VOCAB_QWEN3)
    gate, up = hf["model.layers.1.mlp.gate_proj.weight"], hf["model.layers.1.mlp.up_proj.weight"]
    shard = hf_to_megatron(hf, layout, tp_rank=1, tp_size=2)
    fc1 = shard["decoder.layers.1.mlp.linear_fc1.weight"]
    assert torch.equal(fc1[:64], gate[64:]) and torch.equal(fc1[64:], up[64:])
    down = hf["model.layers.1.mlp.down_proj.weight"]
    assert torch.equal(shard["decoder.layers.1.mlp.linear_fc2.weight"], down[:, 64:])
    assert "output_layer.weight" not in shard  # tied: the output layer reads the embedding
    # 510 rows padded to 512 and split 4 x 128: rank 3 holds rows 384..509 and two zero rows.
    embed = hf_to_megatron(hf, layout, tp_rank=3, tp_size=4)["embedding.word_embeddings.weight"]
    assert embed.shape == (128, 64)
    assert torch.equal(embed[:126], hf["model.embed_tokens.weight"][384:])
    assert torch.count_nonzero(embed[126:]) == 0


def test_transformer_engine_names_put_norms_inside_the_linears():
    hf, layout = hf_state(TINY_LLAMA)
    shard = hf_to_megatron(hf, layout, tp_rank=0, tp_size=1, fused_norms=True)
    assert "decoder.layers.0.self_attention.linear_qkv.layer_norm_weight" in shard
    assert "decoder.layers.0.mlp.linear_fc1.layer_norm_weight" in shard
    assert not any("input_layernorm" in name or "pre_mlp_layernorm" in name for name in shard)
    assert_weights_bitwise_equal(megatron_to_hf([shard], layout, fused_norms=True), hf)


def test_experts_hold_their_gate_and_up_rows_and_the_router_its_weight():
    hf, layout = hf_state(TINY_QWEN3_MOE)
    gate_up = hf["model.layers.1.mlp.experts.gate_up_proj"]  # [experts, 2 * 32, 64]: gate rows, then up rows
    shard = hf_to_megatron(hf, layout, tp_rank=1, tp_size=2)
    fc1 = shard["decoder.layers.1.mlp.experts.local_experts.3.linear_fc1.weight"]
    assert torch.equal(fc1[:16], gate_up[3, 16:32]) and torch.equal(fc1[16:], gate_up[3, 48:])
    down = hf["model.layers.1.mlp.experts.down_proj"]
    assert torch.equal(shard["decoder.layers.1.mlp.experts.local_experts.3.linear_fc2.weight"], down[3][:, 16:])
    assert torch.equal(shard["decoder.layers.1.mlp.router.weight"], hf["model.layers.1.mlp.gate.weight"])


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"model_type": "qwen3_moe", "num_experts": 4, "moe_intermediate_size": 32, "mlp_only_layers": [1]}, "dense layers between expert layers"),
        ({"model_type": "gemma3_text"}, "model_type 'gemma3_text' is not supported"),
        ({"hidden_act": "gelu"}, "hidden_act 'gelu'"),
        ({"attention_bias": True}, "attention_bias=True"),
        ({"rope_scaling": {"rope_type": "linear", "factor": 2.0}}, "rope type 'linear'"),
    ],
)
def test_unsupported_models_are_refused_by_name(change, message):
    with pytest.raises(ValueError, match=message):
        layout_from_hf_config(build_hf_config({**TINY_QWEN3, **change}))


def test_tensor_parallel_must_divide_the_heads():
    hf, layout = hf_state(TINY_QWEN3)
    with pytest.raises(ValueError, match=r"tensor_parallel=3 does not divide the model's num_attention_heads \(4\)"):
        hf_to_megatron(hf, layout, tp_rank=0, tp_size=3)


@pytest.mark.parametrize("tp", [1, 2])
def test_round_trip_with_experts_split_over_expert_parallel_ranks(tp):
    hf, layout = hf_state(TINY_QWEN3_NEXT)
    ep = 2
    # Every (tp, ep) shard; megatron_to_hf takes each tensor-parallel rank with every expert, numbered globally.
    shards = []
    for r in range(tp):
        merged: dict[str, torch.Tensor] = {}
        for e in range(ep):
            part = hf_to_megatron(hf, layout, tp_rank=r, tp_size=tp, ep_rank=e, ep_size=ep)
            for name, t in part.items():
                if ".local_experts." in name:
                    local = int(name.split(".local_experts.")[1].split(".")[0])
                    name = expert_name(name, e * (layout.num_experts // ep) + local)
                merged[name] = t
        shards.append(merged)
    assert_weights_bitwise_equal(megatron_to_hf(shards, layout), hf)


def test_gated_delta_net_in_proj_holds_each_ranks_q_k_v_z_b_a():
    hf, layout = hf_state(TINY_QWEN3_NEXT)  # key heads 2 (dim 16), value heads 4 (dim 16): 2 value heads per key head
    qkvz = hf["model.layers.0.linear_attn.in_proj_qkvz.weight"].reshape(2, 16 + 16 + 32 + 32, -1)  # per key head
    ba = hf["model.layers.0.linear_attn.in_proj_ba.weight"].reshape(2, 4, -1)  # per key head: b (2), a (2)
    shard = hf_to_megatron(hf, layout, tp_rank=1, tp_size=2)  # rank 1: key head 1, value heads 2 and 3
    in_proj = shard["decoder.layers.0.self_attention.in_proj.weight"]
    q, k, v, z, b, a = in_proj.split([16, 16, 32, 32, 2, 2])
    head = qkvz[1]
    assert torch.equal(q, head[:16]) and torch.equal(k, head[16:32])
    assert torch.equal(v, head[32:64]) and torch.equal(z, head[64:])
    assert torch.equal(b, ba[1, :2]) and torch.equal(a, ba[1, 2:])
    conv = hf["model.layers.0.linear_attn.conv1d.weight"]  # channels: q (2 x 16), k (2 x 16), v (4 x 16)
    mine = shard["decoder.layers.0.self_attention.conv1d.weight"]
    assert torch.equal(mine, torch.cat([conv[16:32], conv[48:64], conv[96:128]]))
    for name in ("A_log", "dt_bias"):
        assert torch.equal(shard[f"decoder.layers.0.self_attention.{name}"], hf[f"model.layers.0.linear_attn.{name}"][2:])
    assert torch.equal(shard["decoder.layers.0.self_attention.out_proj.weight"], hf["model.layers.0.linear_attn.out_proj.weight"][:, 32:])


def test_gated_attention_groups_each_query_head_with_its_gate():
    hf, layout = hf_state(TINY_QWEN3_NEXT)  # 4 query heads of 32, interleaved with their gates in q_proj
    q_proj = hf["model.layers.1.self_attn.q_proj.weight"].reshape(4, 2, 32, -1)  # [head, (query, gate), D, H]
    k, v = hf["model.layers.1.self_attn.k_proj.weight"], hf["model.layers.1.self_attn.v_proj.weight"]
    qkv = hf_to_megatron(hf, layout, tp_rank=1, tp_size=2)["decoder.layers.1.self_attention.linear_qkv.weight"]
    # rank 1: query group 1 = query heads 2, 3; then their gates; then key and value head 1
    query, gate, key, value = qkv.split([64, 64, 32, 32])
    assert torch.equal(query, q_proj[2:, 0].reshape(64, -1)) and torch.equal(gate, q_proj[2:, 1].reshape(64, -1))
    assert torch.equal(key, k[32:]) and torch.equal(value, v[32:])
    shared = hf_to_megatron(hf, layout, tp_rank=0, tp_size=1)
    assert torch.equal(shared["decoder.layers.1.mlp.shared_experts.gate_weight"], hf["model.layers.1.mlp.shared_expert_gate.weight"])
