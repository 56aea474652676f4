"""fp32 matrix products on CPU: PyTorch's BLAS (``F.linear``, MKL in the PyPI wheels) vs oneDNN
(``skyrl_core.ops.onednn.linear``), side by side in one run.

Two levels, alternating A/B so that a busy machine slows both alike:

1. GEMM shapes of a SmolLM2-135M training micro-batch (16 sequences x 72 tokens = 1152 rows;
   hidden 576, FFN 1536, vocabulary 49152 on the 512 response rows): forward + both backward
   products, in GFLOP/s.
2. The FSDP backend (``backend.options.cpu_gemm: torch | onednn``) on a SmolLM2-width model
   (``--layers`` of the 30 layers, random weights): ``forward_backward`` of 64 sequences
   (40 prompt + 32 response tokens, micro-batches of 16), seconds.
3. The same ``forward_backward`` (oneDNN) in two child processes, one with the tuned heap
   (``skyrl_core.heap``, the default) and one with ``SKYRL_HEAP_TUNING=0`` (glibc's defaults).

The last line is the ratio of median FSDP step times (onednn / torch); below 1 means oneDNN is faster.

    python benchmarks/cpu_gemm.py [--threads 2] [--repeats 3] [--layers 4]
"""

from __future__ import annotations

import argparse
import statistics
import time

SHAPES = {  # (rows, in, out)
    "q/o proj": (1152, 576, 576),
    "gate/up": (1152, 576, 1536),
    "down": (1152, 1536, 576),
    "lm_head": (512, 576, 49152),
}


def timed(fn, repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        fn()
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def gemm_rates(repeats: int) -> None:
    import torch
    import torch.nn.functional as F

    from skyrl_core.ops.onednn import linear as onednn_linear

    print(f"{'shape':10} {'rows x in x out':>18} {'torch GFLOP/s':>14} {'onednn GFLOP/s':>15} {'speed-up':>9}")
    for name, (m, k, n) in SHAPES.items():
        x = torch.randn(m, k, requires_grad=True)
        w = torch.randn(n, k, requires_grad=True)
        grad = torch.randn(m, n)
        flops = 3 * 2 * m * k * n  # forward, grad_x, grad_w

        def step(fn):
            def run():
                x.grad = w.grad = None
                fn(x, w).backward(grad)
            return run

        rate = {"torch": [], "onednn": []}
        for _ in range(repeats):
            rate["torch"].append(flops / timed(step(F.linear), 1) / 1e9)
            rate["onednn"].append(flops / timed(step(onednn_linear), 1) / 1e9)
        t, o = statistics.median(rate["torch"]), statistics.median(rate["onednn"])
        print(f"{name:10} {f'{m} x {k} x {n}':>18} {t:14.1f} {o:15.1f} {o / t:8.2f}x")


def fsdp_steps(repeats: int, layers: int) -> tuple[float, float]:
    import torch

    from skyrl_core.config.loader import structure_options
    from skyrl_core.config.schema import ModelConfig, TrainerConfig
    from skyrl_core.plugins.manager import get_plugin_manager
    from skyrl_core.types import TrainingBatch

    model = ModelConfig(config={
        "model_type": "llama", "vocab_size": 49152, "hidden_size": 576, "intermediate_size": 1536,
        "num_hidden_layers": layers, "num_attention_heads": 9, "num_key_value_heads": 3, "head_dim": 64,
        "tie_word_embeddings": True, "max_position_embeddings": 512,
    })
    rows, prompt, response = 64, 40, 32
    ids = torch.randint(3, 49152, (rows, prompt + response), generator=torch.Generator().manual_seed(0))
    batch = TrainingBatch(input_ids=ids, attention_mask=torch.ones_like(ids), loss_mask=torch.ones(rows, response))

    def loss_fn(logprobs, batch):
        return -(logprobs * batch.loss_mask).sum() / batch.loss_mask.sum(), {}

    spec = get_plugin_manager().spec("training_backend", "fsdp")
    backends = {
        gemm: spec.load_factory()(model, structure_options(spec, {"cpu_gemm": gemm}, path="fsdp"), seed=0,
                                  trainer=TrainerConfig(micro_batch_size=16))
        for gemm in ("torch", "onednn")
    }
    times = {gemm: [] for gemm in backends}
    try:
        for gemm, backend in backends.items():  # warm-up
            backend.forward_backward(batch, loss_fn)
        for _ in range(repeats):
            for gemm, backend in backends.items():
                started = time.perf_counter()
                backend.forward_backward(batch, loss_fn)
                times[gemm].append(time.perf_counter() - started)
    finally:
        for backend in backends.values():
            backend.close()
    return statistics.median(times["torch"]), statistics.median(times["onednn"])


def heap_child(repeats: int, layers: int) -> list[float]:
    """``forward_backward`` times of one oneDNN backend in this process (a child of ``main``)."""
    import torch

    from skyrl_core.config.loader import structure_options
    from skyrl_core.config.schema import ModelConfig, TrainerConfig
    from skyrl_core.plugins.manager import get_plugin_manager
    from skyrl_core.types import TrainingBatch

    model = ModelConfig(config={
        "model_type": "llama", "vocab_size": 49152, "hidden_size": 576, "intermediate_size": 1536,
        "num_hidden_layers": layers, "num_attention_heads": 9, "num_key_value_heads": 3, "head_dim": 64,
        "tie_word_embeddings": True, "max_position_embeddings": 512,
    })
    ids = torch.randint(3, 49152, (64, 72), generator=torch.Generator().manual_seed(0))
    batch = TrainingBatch(input_ids=ids, attention_mask=torch.ones_like(ids), loss_mask=torch.ones(64, 32))
    spec = get_plugin_manager().spec("training_backend", "fsdp")
    backend = spec.load_factory()(model, structure_options(spec, {"cpu_gemm": "onednn"}, path="fsdp"), seed=0,
                                  trainer=TrainerConfig(micro_batch_size=16))

    def loss_fn(logprobs, batch):
        return -(logprobs * batch.loss_mask).sum() / batch.loss_mask.sum(), {}

    backend.forward_backward(batch, loss_fn)  # warm-up
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        backend.forward_backward(batch, loss_fn)
        times.append(time.perf_counter() - started)
    backend.close()
    return times


def heap_comparison(args) -> tuple[float, float]:
    """Median ``forward_backward`` seconds: (tuned heap, glibc defaults), children alternating."""
    import json
    import os
    import subprocess
    import sys

    times: dict[str, list[float]] = {"1": [], "0": []}
    for _ in range(2):
        for tuning in ("1", "0"):
            command = [sys.executable, __file__, "--heap-child", "--threads", str(args.threads),
                       "--repeats", str(args.repeats), "--layers", str(args.layers)]
            out = subprocess.run(command, env={**os.environ, "SKYRL_HEAP_TUNING": tuning}, check=True,
                                 stdout=subprocess.PIPE, text=True).stdout
            times[tuning] += json.loads(out.strip().splitlines()[-1])
    return statistics.median(times["1"]), statistics.median(times["0"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--layers", type=int, default=4, help="decoder layers of the SmolLM2-width model")
    parser.add_argument("--heap-child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()

    import torch

    if args.heap_child:
        import json

        torch.set_num_threads(args.threads)
        print(json.dumps(heap_child(args.repeats, args.layers)))
        return

    from skyrl_core.ops.onednn import available

    torch.set_num_threads(args.threads)
    if not available():
        raise SystemExit("this PyTorch has no oneDNN linear kernel (torch.ops.mkldnn._linear_pointwise)")
    print(f"threads {args.threads}; {torch.__config__.show().splitlines()[1].strip()}")
    gemm_rates(args.repeats)
    torch_s, onednn_s = fsdp_steps(args.repeats, args.layers)
    print(f"FSDP forward_backward, 64 x 72 tokens, {args.layers} SmolLM2-width layers: "
          f"cpu_gemm=torch {torch_s:.2f} s, cpu_gemm=onednn {onednn_s:.2f} s")
    tuned, stock = heap_comparison(args)
    print(f"FSDP forward_backward (onednn) in child processes: tuned heap {tuned:.2f} s, "
          f"SKYRL_HEAP_TUNING=0 {stock:.2f} s, ratio {tuned / stock:.2f}")
    print(f"median step onednn / torch: {onednn_s / torch_s:.2f}")


if __name__ == "__main__":
    main()
