"""bf16 on a CPU: a skyrl-torch rollout (64 x 32 new tokens) and one FSDP ``forward_backward``
(16 x 62 tokens) with skyrl's default bf16 products against PyTorch's own bf16 path, fp32 beside,
side by side in one run, with the ratios.

On a CPU where oneDNN computes bf16 (AVX-512 and newer) the default is oneDNN's bf16; on one where it
does not (AVX2 only) the default multiplies in fp32 and rounds to bf16 (``docs/training.md``, bf16):
the engine's ``gemm: onednn_fp32``, the trainer's ``fp32_products.linear``. PyTorch's own path is the
engine with ``cpu_gemm: torch`` and the trainer with the stock ``F.linear`` in bf16. The model:
SmolLM2-135M's widths (hidden 576, MLP 1536, 9/3 heads, vocabulary 49152) with LAYERS decoder
layers, random weights (speed does not depend on them).

    python benchmarks/bf16_cpu_paths.py [LAYERS]   (default 8)
"""

from __future__ import annotations

import sys
import time

import torch

from skyrl_core.config.schema import ModelConfig, TrainerConfig
from skyrl_core.ops import onednn
from skyrl_core.testing.backend_contract import make_batch, mean_logprob_loss, random_sequences
from skyrl_core.testing.engine_contract import request


def smollm2_widths(layers: int) -> dict:
    return dict(model_type="llama", hidden_size=576, intermediate_size=1536, num_hidden_layers=layers,
                num_attention_heads=9, num_key_value_heads=3, head_dim=64, vocab_size=49152,
                max_position_embeddings=2048, rms_norm_eps=1e-5, tie_word_embeddings=True)


def rollout(config: dict, dtype: str, cpu_gemm: str) -> tuple[float, str]:
    """Tokens per second of 8 prompts x 8 samples x 32 new tokens (after a warm-up request)."""
    from skyrl_torch.engine import TorchEngine
    from skyrl_torch.options import TorchEngineOptions

    engine = TorchEngine(ModelConfig(config=config, dtype=dtype), TorchEngineOptions(cpu_gemm=cpu_gemm), seed=0)
    try:
        requests = [request(list(range(10 + i, 40 + i)), str(i), n=8, seed=i, max_tokens=32, temperature=1.0) for i in range(8)]
        engine.generate(requests[:1])
        start = time.perf_counter()
        out = engine.generate(requests)
        seconds = time.perf_counter() - start
        return sum(len(s.token_ids) for group in out for s in group) / seconds, engine.execution_contract()["gemm"]
    finally:
        engine.close()


def forward_backward(config: dict, mixed_precision: str, stock_bf16: bool) -> float:
    """Seconds of the second ``forward_backward`` on 16 rows of 30 prompt + 32 response tokens."""
    import skyrl_fsdp.rank as rank
    from skyrl_fsdp.backend import FSDPBackend
    from skyrl_fsdp.options import FSDPOptions

    chosen = rank.linear_defaults
    if stock_bf16:  # PyTorch's own bf16 kernels: no default linear for bf16
        rank.linear_defaults = lambda gemm, dtype, device="cpu": {} if dtype == torch.bfloat16 else chosen(gemm, dtype, device)
    try:
        backend = FSDPBackend(ModelConfig(config=config), FSDPOptions(world_size=1, device="cpu", mixed_precision=mixed_precision),
                              trainer=TrainerConfig(micro_batch_size=16))
        batch = make_batch(*random_sequences((30,) * 16, (32,) * 16, vocab_size=config["vocab_size"]))
        backend.forward_backward(batch, mean_logprob_loss)
        start = time.perf_counter()
        backend.forward_backward(batch, mean_logprob_loss)
        seconds = time.perf_counter() - start
        backend.close()
        return seconds
    finally:
        rank.linear_defaults = chosen


def main() -> None:
    layers = int(sys.argv[1]) if len(sys.argv) > 1 else 8
    torch.set_num_threads(2)
    config = smollm2_widths(layers)
    print(f"SmolLM2 widths, {layers} layers, 2 threads; oneDNN bf16 products on this CPU: {onednn.bf16_supported()}")
    fp32, _ = rollout(config, "float32", "onednn")
    default, gemm = rollout(config, "bfloat16", "onednn")
    stock, _ = rollout(config, "bfloat16", "torch")
    print(f"rollout tok/s: fp32 {fp32:.1f} | bf16 default ({gemm}) {default:.1f} | bf16 PyTorch's path {stock:.1f}")
    print(f"  bf16 default / PyTorch's path: {default / stock:.2f}x faster; bf16 default / fp32: {default / fp32:.2f}x")
    t_fp32 = forward_backward(config, "fp32", False)
    t_default = forward_backward(config, "bf16", False)
    t_stock = forward_backward(config, "bf16", True)
    print(f"forward_backward s: fp32 {t_fp32:.2f} | bf16 default {t_default:.2f} | bf16 PyTorch's path {t_stock:.2f}")
    print(f"  bf16 default / PyTorch's path: {t_stock / t_default:.2f}x faster; bf16 default / fp32: {t_fp32 / t_default:.2f}x")


if __name__ == "__main__":
    main()
