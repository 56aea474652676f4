"""Options of the native engine (``engine: {name: torch, options: {...}}``). Light: no torch import."""

from __future__ import annotations

import attrs

from skyrl_core.config.validators import boolean, non_negative_int, one_of, optional_positive_int, positive_int

ATTENTION_KINDS = ("model", "sdpa", "eager")
IMPLEMENTATIONS = ("auto", "native", "transformers")
CPU_GEMMS = ("onednn", "torch")
DEVICES = ("cpu", "cuda")


@attrs.frozen(kw_only=True)
class TorchEngineOptions:
    """How the native engine batches and where it keeps its KV cache."""

    max_num_seqs: int = attrs.field(
        default=64,
        validator=positive_int,
        metadata={"help": "KV-cache slots: samples decoded together; more samples wait and join as others finish"},
    )
    kv_cache_memory_bytes: int | None = attrs.field(
        default=None,
        validator=optional_positive_int,
        metadata={
            "help": "most bytes the KV cache may take (slots x (longest request in them + 1) positions, every "
            "attention layer's keys and values): samples wait for slots when more would not fit, and a request "
            "one sample of which cannot fit alone is refused; default: a quarter of the machine's physical "
            "memory, or of its cgroup's limit if smaller (device cpu), or of the GPU's total memory (device cuda)"
        },
    )
    max_model_len: int | None = attrs.field(
        default=None,
        validator=optional_positive_int,
        metadata={"help": "longest prompt + response in tokens (default: the model's max_position_embeddings)"},
    )
    shared_prefix_min_tokens: int = attrs.field(
        default=16,
        validator=non_negative_int,
        metadata={
            "help": "prefill a prefix common to the prompts admitted together only once when it is at least "
            "this long (0: never)"
        },
    )
    implementation: str = attrs.field(
        default="auto",
        validator=one_of(*IMPLEMENTATIONS),
        metadata={
            "help": "native: a lean forward for Llama/Mistral/Qwen2/Qwen3 over the model's weights (over an op "
            "plugin's ops, such as IsoExec's, when one installs them all); transformers: the model's own modules "
            "(any causal LM); auto: native when possible"
        },
    )
    cpu_gemm: str = attrs.field(
        default="onednn",
        validator=one_of(*CPU_GEMMS),
        metadata={
            "help": "matrix products of the native implementation on CPU: onednn (fp32, often several times faster "
            "than torch's BLAS at decode batch sizes) or torch (F.linear); falls back to torch without oneDNN, and for a bf16 "
            "model on a CPU where oneDNN has no bf16 products (AVX2 only)"
        },
    )
    prepack_weights: bool = attrs.field(
        default=True,
        validator=boolean,
        metadata={
            "help": "with cpu_gemm=onednn, the native implementation's GEMMs (fp32; bf16 where oneDNN computes bf16, AVX-512 or newer) read copies of the weights "
            "reordered once into oneDNN's layout (same bits, 12-25% faster per decode-sized GEMM; renewed after "
            "each weight update; a second copy of the projection weights in memory): false saves that memory"
        },
    )
    torch_gemm_below_macs: int = attrs.field(
        default=1 << 21,
        validator=non_negative_int,
        metadata={
            "help": "with cpu_gemm=onednn, an fp32 product of the native implementation with fewer multiply-adds "
            "than this (rows x in x out) goes through torch (F.linear / addmm) instead: oneDNN's per-call cost "
            "outweighs its faster kernel there (measured per product on 2 cores: torch 0.57-0.90x oneDNN's time "
            "at 0.5-2.1M, 1.02-1.22x at 4.2M; a tiny 64-wide Qwen3 generates in 0.86x the time); 0: never"
        },
    )
    attention: str = attrs.field(
        default="sdpa",
        validator=one_of(*ATTENTION_KINDS),
        metadata={
            "help": "attention of the transformers implementation: sdpa, eager, or model (what the loaded model uses)"
        },
    )
    device: str = attrs.field(
        default="cpu", validator=one_of(*DEVICES), metadata={"help": "where the model and KV cache live"}
    )
    threads: int | None = attrs.field(
        default=None,
        validator=optional_positive_int,
        metadata={
            "help": "CPU intra-op threads of generation (set on the thread that drives the scheduler while it "
            "drives, then restored): when generation runs beside training on the same cores (trainer.mode "
            "one_step_off / fully_async), generation threads + training threads <= cores avoids "
            "oversubscription; default: the calling thread's (torch.get_num_threads())"
        },
    )
    one_thread_below_macs: int = attrs.field(
        default=1 << 24,
        validator=non_negative_int,
        metadata={
            "help": "a prefill or decode step whose weight products take fewer multiply-adds than this (tokens fed "
            "x the model's weights per token) runs on one thread, whatever `threads` says: a second thread "
            "gains nothing on so little work and its parallel regions stall whenever another process holds a "
            "core (measured on 2 cores: 2-layer 64-wide models at 64 rows, 8-10M a step, generated as fast on "
            "one thread alone and 1.2-1.3x faster beside a process using a fifth of a core; 128 wide, 42M, "
            "was 1.2x faster on two threads alone); 0: never"
        },
    )
    threads_beside_training: int | None = attrs.field(
        default=None,
        validator=optional_positive_int,
        metadata={
            "help": "CPU intra-op threads of generation while this process's trainer computes (trainer.mode "
            "one_step_off / fully_async with engine.placement: colocated), chosen again at every decode step; "
            "while the trainer waits, generation takes `threads` (or the caller's); null: always `threads`"
        },
    )
