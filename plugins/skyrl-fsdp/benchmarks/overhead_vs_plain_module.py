"""FSDP backend (world size 1, CPU) vs the same training step on a plain transformers module.

Both run the same micro-batched forward/backward + clip + AdamW on the same batch, alternating, in one
process; prints the median seconds per step of each and the ratio (fsdp / plain) on the last line.
The ratio is FSDP2's own cost at world size 1 (parameter all-gather copies, hooks, DTensor ops).

    .venv/bin/python plugins/skyrl-fsdp/benchmarks/overhead_vs_plain_module.py [--layers 8] [--rounds 5]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from skyrl_core.config.schema import ModelConfig, TrainerConfig
from skyrl_core.models import load_causal_lm
from skyrl_core.testing.backend_contract import make_batch, mean_logprob_loss, random_sequences
from skyrl_fsdp.backend import FSDPBackend
from skyrl_fsdp.options import FSDPOptions


def plain_step(model_config: ModelConfig, batch, micro_batch_size: int):
    model = load_causal_lm(model_config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)
    R = batch.response_len

    def step() -> None:
        for micro in batch.split(micro_batch_size):
            ids, mask = micro.input_ids, micro.attention_mask
            position_ids = (mask.cumsum(-1) - 1).clamp_min(0)
            logits = model(input_ids=ids, attention_mask=mask, position_ids=position_ids, logits_to_keep=R + 1).logits[:, :-1]
            logprobs = torch.log_softmax(logits.float(), -1).gather(-1, ids[:, -R:, None])[..., 0]
            mean_logprob_loss(logprobs, micro)[0].backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad()

    return step


def fsdp_step(model_config: ModelConfig, batch, micro_batch_size: int):
    backend = FSDPBackend(model_config, FSDPOptions(device="cpu"), trainer=TrainerConfig(lr=1e-5, micro_batch_size=micro_batch_size))

    def step() -> None:
        backend.forward_backward(batch, mean_logprob_loss)
        backend.optim_step()

    return step


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--rows", type=int, default=16)
    parser.add_argument("--micro-batch-size", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model_config = ModelConfig(
        config={
            "model_type": "llama",
            "hidden_size": args.hidden,
            "intermediate_size": args.hidden * 8 // 3,
            "num_hidden_layers": args.layers,
            "num_attention_heads": args.hidden // 64,
            "num_key_value_heads": max(1, args.hidden // 192),
            "head_dim": 64,
            "vocab_size": args.vocab,
            "tie_word_embeddings": True,
        }
    )
    batch = make_batch(*random_sequences((40,) * args.rows, (32,) * args.rows, vocab_size=args.vocab))
    steps = {"plain": plain_step(model_config, batch, args.micro_batch_size), "fsdp": fsdp_step(model_config, batch, args.micro_batch_size)}
    times: dict[str, list[float]] = {name: [] for name in steps}
    for step in steps.values():  # warm-up
        step()
    for _ in range(args.rounds):
        for name, step in steps.items():
            start = time.perf_counter()
            step()
            times[name].append(time.perf_counter() - start)
    plain, fsdp = statistics.median(times["plain"]), statistics.median(times["fsdp"])
    print(f"plain module: median {plain:.3f} s/step   fsdp world size 1: median {fsdp:.3f} s/step")
    print(f"fsdp / plain = {fsdp / plain:.2f}")


if __name__ == "__main__":
    main()
