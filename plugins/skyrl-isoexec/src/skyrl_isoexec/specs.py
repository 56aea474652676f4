"""The canonical implementations as ``OpImplSpec`` records: id, version, pinned constants, factory.

Importable without torch: registration and contracts never import the kernels.
"""

from __future__ import annotations

from skyrl_core.plugins.records import OpImplSpec
from skyrl_isoexec import constants as C

_K = "skyrl_isoexec.kernels"

CANONICAL: dict[str, OpImplSpec] = {
    spec.op: spec
    for spec in (
        OpImplSpec(
            name="isoexec.embedding", op="embedding", version="1", factory=f"{_K}.elementwise:embedding",
            constants={"kind": "gather"}, description="row gather (exact)",
        ),
        OpImplSpec(
            name="isoexec.linear", op="linear", version="3", factory=f"{_K}.linear:linear",
            constants={
                "row_align": C.LINEAR_ROW_ALIGN,
                "min_columns": C.LINEAR_MIN_COLUMNS,
                "kernel": C.LINEAR_KERNEL,
            },
            description="GEMM over rows zero-padded to a multiple of 8: each row independent of the others",
        ),
        OpImplSpec(
            name="isoexec.rms_norm", op="rms_norm", version="2", factory=f"{_K}.elementwise:rms_norm",
            constants={"sum": "torch.mm of rows padded to 8 against an [8, K] matrix of ones, fp32", "gate": "x/(1+exp(-x))"},
            description="RMSNorm whose fp32 sum of squares is a row-aligned GEMM",
        ),
        OpImplSpec(
            name="isoexec.rope", op="rope", version="1", factory=f"{_K}.elementwise:rope",
            constants={"table_block": C.ROPE_TABLE_BLOCK, "dtype": "float32"},
            description="one shared fp32 cos/sin table, built in fixed position blocks",
        ),
        OpImplSpec(
            name="isoexec.attention", op="attention", version="3", factory=f"{_K}.attention:attention",
            constants={
                "row_align": C.ATTENTION_ROW_ALIGN,
                "key_block": C.ATTENTION_KEY_BLOCK,
                "softmax": "torch.softmax over key slots, fp32, masked slots -inf",
                "combine": "one GEMM per key block, halving tree over key blocks",
            },
            description="reduces over exactly the visible keys in fixed blocks aligned at the sequence start",
        ),
        OpImplSpec(
            name="isoexec.silu_mul", op="silu_mul", version="1", factory=f"{_K}.elementwise:silu_mul",
            constants={"silu": "x/(1+exp(-x))", "dtype": "float32"},
            description="silu(gate) * up in fp32, rounded once",
        ),
        OpImplSpec(
            name="isoexec.logprobs", op="logprobs", version="2", factory=f"{_K}.logprobs:logprobs",
            constants={"dtype": "float32", "kernel": "torch.log_softmax over the last dim (rows computed alone)"},
            description="fp32 log-softmax, each row computed alone",
        ),
        OpImplSpec(
            name="isoexec.moe_router", op="moe_router", version="1", factory=f"{_K}.moe:router",
            constants={"softmax": "fp32, halving-tree sum", "topk": "torch.topk, sorted"},
            description="canonical router logits, fp32 softmax, top-k, tree-normalised weights",
        ),
        OpImplSpec(
            name="isoexec.moe_experts", op="moe_experts", version="1", factory=f"{_K}.moe:experts",
            constants={"gemm": "isoexec.linear row blocks per expert"},
            description="per-expert row-block GEMMs over the tokens routed to it",
        ),
        OpImplSpec(
            name="isoexec.moe_combine", op="moe_combine", version="1", factory=f"{_K}.moe:combine",
            constants={"order": C.MOE_COMBINE_ORDER},
            description="weighted sum of the top-k expert outputs in slot order",
        ),
        OpImplSpec(
            name="isoexec.gdn_conv", op="gdn_conv", version="1", factory=f"{_K}.gdn:conv",
            constants={"order": "taps oldest to newest, fp32", "activation": "x/(1+exp(-x))"},
            description="causal depthwise conv as a fixed-order sum of shifted taps",
        ),
        OpImplSpec(
            name="isoexec.gdn_core", op="gdn_core", version="1", factory=f"{_K}.gdn:core",
            constants={"scan": C.GDN_SCAN},
            description="gated delta rule as one recurrent scan with an fp32 state at every site",
        ),
    )
}
