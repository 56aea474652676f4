"""Peak memory of one training step against tokens per sample: skyrl's FSDP backend beside TRL's
``GRPOTrainer``, and skyrl at two vocabulary sizes.

Each measurement runs in a fresh subprocess that builds its trainer, records its resident set
before the step, runs one step (forward, loss, backward, optimizer step) on ``--rows`` rows of
``L`` tokens (a 32-token prompt and an ``L - 32``-token response, random ids), and reports its peak
resident set (``resource.getrusage``). Printed: the peak, the step's own growth (peak minus before),
and the slope of the peak in MB per 1k tokens per sample, from the smallest to the largest length.

- skyrl: SmolLM2-135M (fp32, world size 1), micro-batches of all rows (``micro_batch_tokens`` =
  rows x L), logits ``logprob_chunk_tokens`` positions at a time; with and without activation
  checkpointing.
- TRL: ``GRPOTrainer.compute_loss`` on the same rows (``loss_type=grpo``, ``beta=0``), then
  backward and its AdamW step: the whole ``[rows, L, vocab]`` logits exist, with and without
  ``gradient_checkpointing``.
- vocabulary: a 2-layer model of hidden 64 at vocab 32k and 128k: the step's growth differs by the
  weights' fp32 state (16 bytes a parameter) and one logits chunk, not by rows x L x vocab.

A measurement whose predicted peak exceeds ``--max-gib`` is skipped and says so (TRL at long
lengths: its logits alone are rows x L x 49k x 4 bytes per copy).

    python benchmarks/memory_scaling.py               # 1k 2k 4k 8k, 2 rows
    python benchmarks/memory_scaling.py --lengths 1024 2048 --rows 2
    python benchmarks/memory_scaling.py --rows 1 --checkpointing on   # the checkpointed sweeps only
    python benchmarks/memory_scaling.py --heap-mmap-mib 4   # as trainer.heap_mmap_threshold_mib: 4
    SKYRL_MEMORY_BENCH_MODEL=DIR python benchmarks/memory_scaling.py   # another model directory
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from typing import Any

PROMPT = 32
SMOLLM2 = os.environ.get("SKYRL_MEMORY_BENCH_MODEL", os.path.expanduser("~/.cache/skyrl/models/SmolLM2-135M-Instruct"))
TINY = {"model_type": "llama", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "max_position_embeddings": 16384,
        "tie_word_embeddings": True}
MB = 1e6


def _rss() -> int:
    import psutil

    return psutil.Process().memory_info().rss


def _peak() -> int:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # kilobytes on Linux


def _rows(rows: int, length: int, vocab: int) -> Any:
    import torch

    g = torch.Generator().manual_seed(0)
    return torch.randint(3, vocab, (rows, length), generator=g)


def measure_skyrl(length: int, rows: int, checkpointing: bool, model: dict[str, Any] | None) -> dict[str, float]:
    import torch

    from skyrl_core.config.schema import ModelConfig, TrainerConfig
    from skyrl_core.types import TrainingBatch
    from skyrl_fsdp.backend import FSDPBackend
    from skyrl_fsdp.options import FSDPOptions

    torch.set_num_threads(2)
    if os.environ.get("SKYRL_HEAP_MMAP_MIB"):  # --heap-mmap-mib: what trainer.heap_mmap_threshold_mib sets
        from skyrl_core.heap import keep_freed_memory, set_mmap_threshold

        keep_freed_memory()
        set_mmap_threshold(int(os.environ["SKYRL_HEAP_MMAP_MIB"]))
    config = ModelConfig(config=model) if model else ModelConfig(path=SMOLLM2)
    trainer = TrainerConfig(lr=1e-6, micro_batch_size=rows, micro_batch_tokens=rows * length,
                            activation_checkpointing=checkpointing)
    backend = FSDPBackend(config, FSDPOptions(device="cpu"), trainer=trainer)
    vocab = backend._local.model.config.vocab_size
    ids = _rows(rows, length, vocab)
    mask = torch.ones_like(ids)
    loss_mask = torch.ones(rows, length - PROMPT)
    batch = TrainingBatch(input_ids=ids, attention_mask=mask, loss_mask=loss_mask, group_ids=tuple(range(rows)),
                          token_weights=loss_mask / loss_mask.sum())

    def loss_fn(logprobs, micro):
        return -(logprobs * micro.token_weights).sum(), {}

    before = _rss()
    backend.forward_backward(batch, loss_fn)
    backend.optim_step()
    return {"before": before, "peak": _peak()}


def measure_trl(length: int, rows: int, checkpointing: bool) -> dict[str, float]:
    import tempfile

    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    torch.set_num_threads(2)
    tokenizer = AutoTokenizer.from_pretrained(SMOLLM2)
    tokenizer.pad_token = tokenizer.pad_token or tokenizer.eos_token
    model = AutoModelForCausalLM.from_pretrained(SMOLLM2, dtype="float32")
    dataset = Dataset.from_list([{"prompt": "x"}] * rows)
    args = GRPOConfig(
        output_dir=tempfile.mkdtemp(), per_device_train_batch_size=rows, num_generations=rows, beta=0.0,
        loss_type="grpo", use_cpu=True, bf16=False, report_to="none", logging_strategy="no", save_strategy="no",
        gradient_checkpointing=checkpointing, max_completion_length=length - PROMPT, disable_tqdm=True,
    )
    trainer = GRPOTrainer(model=model, reward_funcs=lambda completions, **_: [0.0] * len(completions), args=args,
                          train_dataset=dataset, processing_class=tokenizer)
    trainer.create_optimizer()
    trainer.current_gradient_accumulation_steps = 1  # set by Trainer's loop, which is not run here
    model.train()
    ids = _rows(rows, length, model.config.vocab_size)
    inputs = {
        "prompt_ids": ids[:, :PROMPT], "prompt_mask": torch.ones(rows, PROMPT, dtype=torch.long),
        "completion_ids": ids[:, PROMPT:], "completion_mask": torch.ones(rows, length - PROMPT, dtype=torch.long),
        "advantages": torch.linspace(-1, 1, rows), "old_per_token_logps": None,
        "num_items_in_batch": torch.tensor(float(rows * (length - PROMPT))),
    }
    before = _rss()
    loss = trainer.compute_loss(model, inputs)
    loss.backward()
    trainer.optimizer.step()
    return {"before": before, "peak": _peak()}


def predicted_gib(kind: str, length: int, rows: int, checkpointing: bool) -> float:
    """A rough peak to skip what cannot fit (activations per token from skyrl's estimate, plus TRL's
    logits: about 4 fp32 copies of rows x L x vocab)."""
    from skyrl_core.models import build_hf_config
    from skyrl_core.trainer.memory_estimate import activation_bytes_per_token

    with open(os.path.join(SMOLLM2, "config.json")) as f:
        hf = build_hf_config(json.load(f))
    tokens = rows * length
    peak = 3.0e9 + tokens * activation_bytes_per_token(hf, checkpointing=checkpointing)
    if kind == "trl":
        peak += 4 * tokens * hf.vocab_size * 4
    return peak / 2**30


def run_child(kind: str, length: int, rows: int, checkpointing: bool, vocab: int | None) -> dict[str, float] | str:
    spec = {"kind": kind, "length": length, "rows": rows, "checkpointing": checkpointing, "vocab": vocab}
    done = subprocess.run([sys.executable, __file__, "--child", json.dumps(spec)], capture_output=True, text=True)
    for line in done.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[7:])
    return f"failed (exit {done.returncode}): {done.stderr.strip().splitlines()[-1] if done.stderr.strip() else ''}"


def child(spec: dict[str, Any]) -> None:
    if spec["kind"] == "trl":
        result = measure_trl(spec["length"], spec["rows"], spec["checkpointing"])
    else:
        model = {**TINY, "vocab_size": spec["vocab"]} if spec["vocab"] else None
        result = measure_skyrl(spec["length"], spec["rows"], spec["checkpointing"], model)
    print("RESULT " + json.dumps(result), flush=True)


def sweep(label: str, kind: str, lengths: list[int], rows: int, checkpointing: bool, max_gib: float) -> None:
    print(f"\n{label}")
    print(f"  {'tokens/sample':>13} {'peak MB':>9} {'step growth MB':>15}")
    points = []
    if kind == "trl" and rows < 2:
        print("  skipped: GRPOTrainer needs at least 2 rows (generations per prompt); use --rows 2 or more")
        return
    for length in lengths:
        predicted = predicted_gib(kind, length, rows, checkpointing)
        if predicted > max_gib:
            print(f"  {length:>13} skipped: predicted {predicted:.1f} GiB > --max-gib {max_gib}")
            continue
        result = run_child(kind, length, rows, checkpointing, None)
        if isinstance(result, str):
            print(f"  {length:>13} {result}")
            continue
        points.append((length, result["peak"]))
        print(f"  {length:>13} {result['peak'] / MB:>9.0f} {(result['peak'] - result['before']) / MB:>15.0f}")
    if len(points) >= 2:
        (l0, p0), (l1, p1) = points[0], points[-1]
        print(f"  slope: {(p1 - p0) / MB / ((l1 - l0) / 1000):.0f} MB per 1k tokens per sample ({rows} rows)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[1024, 2048, 4096, 8192])
    parser.add_argument("--rows", type=int, default=2)
    parser.add_argument("--max-gib", type=float, default=12.0, help="skip a measurement predicted above this")
    parser.add_argument("--skip-trl", action="store_true")
    parser.add_argument("--checkpointing", choices=("on", "off", "both"), default="both",
                        help="which sweeps to run: activation checkpointing on, off, or both")
    parser.add_argument("--heap-mmap-mib", type=int, default=None,
                        help="skyrl's steps with trainer.heap_mmap_threshold_mib (default: the heap tuning's 1024)")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(json.loads(args.child))
        return
    if args.heap_mmap_mib is not None:  # children inherit it
        os.environ["SKYRL_HEAP_MMAP_MIB"] = str(args.heap_mmap_mib)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    heap = f"heap mmap threshold {args.heap_mmap_mib} MiB" if args.heap_mmap_mib else "heap tuning's default"
    print(f"peak RSS of one training step, {args.rows} rows, SmolLM2-135M fp32, 2 threads, {heap}; each in a fresh process")
    for checkpointing in {"on": (True,), "off": (False,), "both": (True, False)}[args.checkpointing]:
        state = "on" if checkpointing else "off"
        sweep(f"skyrl (FSDP, chunked logprobs), activation checkpointing {state}", "skyrl", args.lengths, args.rows,
              checkpointing, args.max_gib)
        if not args.skip_trl:
            sweep(f"TRL GRPOTrainer, gradient_checkpointing {state}", "trl", args.lengths, args.rows, checkpointing,
                  args.max_gib)

    length = args.lengths[min(2, len(args.lengths) - 1)]
    print(f"\nvocabulary: skyrl, 2-layer hidden-64 model, {args.rows} rows x {length} tokens, checkpointing off")
    growth = {}
    for vocab in (32_000, 128_000):
        result = run_child("skyrl", length, args.rows, False, vocab)
        if isinstance(result, str):
            print(f"  vocab {vocab}: {result}")
            continue
        growth[vocab] = result["peak"] - result["before"]
        print(f"  vocab {vocab:>7}: peak {result['peak'] / MB:.0f} MB, step growth {growth[vocab] / MB:.0f} MB")
    if len(growth) == 2:
        extra = 96_000
        state = 16 * extra * TINY["hidden_size"]  # gradients and AdamW moments of the larger embedding (+ weights)
        from skyrl_core.config.schema import TrainerConfig

        chunk = 6 * min(TrainerConfig().logprob_chunk_tokens, args.rows * (length - PROMPT)) * extra * 4
        full = args.rows * (length - PROMPT) * extra * 4
        print(f"  growth difference {(growth[128_000] - growth[32_000]) / MB:.0f} MB; weight state of 96k more "
              f"rows {state / MB:.0f} MB + one logits chunk's copies {chunk / MB:.0f} MB; one copy of the full "
              f"logits' difference would be {full / MB:.0f} MB")


if __name__ == "__main__":
    main()
