"""Matrix products on CPU, fp32 and bf16: PyTorch's own path (``F.linear``: MKL for fp32 in the PyPI
wheels, oneDNN's matmul for bf16) vs oneDNN's inner product (``skyrl_core.ops.onednn``), side by
side in one run.

Three levels, alternating A/B so that a busy machine slows both alike:

1. GEMM shapes of a SmolLM2-135M training micro-batch (16 sequences x 72 tokens = 1152 rows;
   hidden 576, FFN 1536, vocabulary 49152 on the 512 response rows): forward + both backward
   products, in GFLOP/s, for fp32 torch (MKL), fp32 oneDNN, bf16 torch and bf16 oneDNN. The
   FLOP-weighted totals say which bf16 path is faster on this machine.
2. The FSDP backend on a SmolLM2-width model (``--layers`` of the 30 layers, random weights):
   ``forward_backward`` of 64 sequences (40 prompt + 32 response tokens, micro-batches of 16) with
   ``cpu_gemm: torch``, ``cpu_gemm: onednn`` (fp32) and ``model.dtype: bfloat16`` (bf16 compute,
   fp32 masters), seconds, each beside this machine's floor for that work
   (``benchmarks/_roofline.py``: the fastest measured rate at each of its GEMM shapes).
3. The same ``forward_backward`` (oneDNN) in two child processes, one with the tuned heap
   (``skyrl_core.heap``, the default) and one with ``SKYRL_HEAP_TUNING=0`` (glibc's defaults).

The last lines are the ratios of median FSDP step times: onednn / torch (fp32; below 1 means
oneDNN is faster) and bf16 / the faster fp32.

    python benchmarks/cpu_gemm.py [--threads 2] [--repeats 3] [--layers 4]
"""

from __future__ import annotations

import argparse
import statistics

import attrs
import time

from _roofline import Roofline, decoder_gemms, machine

SHAPES = {  # (rows, in, out)
    "q/o proj": (1152, 576, 576),
    "gate/up": (1152, 576, 1536),
    "down": (1152, 1536, 576),
    "lm_head": (512, 576, 49152),
}


ROWS, PROMPT, RESPONSE = 64, 40, 32  # the FSDP forward_backward's batch


def smollm2_width(layers: int) -> dict:
    """A random llama of SmolLM2-135M's widths with ``layers`` decoder layers."""
    return {
        "model_type": "llama", "vocab_size": 49152, "hidden_size": 576, "intermediate_size": 1536,
        "num_hidden_layers": layers, "num_attention_heads": 9, "num_key_value_heads": 3, "head_dim": 64,
        "tie_word_embeddings": True, "max_position_embeddings": 512,
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

    from skyrl_core.ops.onednn import computes, mm_nt

    class OneDNNProducts(torch.autograd.Function):
        """All three products on oneDNN's inner product, in any dtype (skyrl's linear: fp32 only)."""

        @staticmethod
        def forward(ctx, x, w):
            ctx.save_for_backward(x, w)
            return mm_nt(x, w)

        @staticmethod
        def backward(ctx, grad):
            x, w = ctx.saved_tensors
            return mm_nt(grad, w.t()), mm_nt(grad.t(), x.t())

    onednn = OneDNNProducts.apply

    paths = {"fp32 torch": (torch.float32, F.linear), "fp32 onednn": (torch.float32, onednn),
             "bf16 torch": (torch.bfloat16, F.linear), "bf16 onednn": (torch.bfloat16, onednn)}
    if not computes(torch.bfloat16):
        del paths["bf16 onednn"]
        print("oneDNN has no bf16 products on this CPU (AVX2 only): bf16 onednn not measured")
    print("GFLOP/s of forward + both backward products (fp32 torch = MKL, bf16 torch = ATen's oneDNN matmul):")
    print(f"{'shape':10} {'rows x in x out':>18} " + " ".join(f"{name:>12}" for name in paths))
    seconds = {name: 0.0 for name in paths}
    for name, (m, k, n) in SHAPES.items():
        flops = 3 * 2 * m * k * n  # forward, grad_x, grad_w
        rate: dict[str, list[float]] = {path: [] for path in paths}
        for dtype in (torch.float32, torch.bfloat16):
            x = torch.randn(m, k, dtype=dtype, requires_grad=True)
            w = torch.randn(n, k, dtype=dtype, requires_grad=True)
            grad = torch.randn(m, n, dtype=dtype)

            def step(fn):
                def run():
                    x.grad = w.grad = None
                    fn(x, w).backward(grad)
                return run

            for _ in range(repeats):
                for path, (path_dtype, fn) in paths.items():
                    if path_dtype == dtype:
                        rate[path].append(flops / timed(step(fn), 1) / 1e9)
        medians = {path: statistics.median(r) for path, r in rate.items()}
        for path, value in medians.items():
            seconds[path] += flops / (value * 1e9)
        print(f"{name:10} {f'{m} x {k} x {n}':>18} " + " ".join(f"{medians[p]:12.1f}" for p in paths))
    total = 3 * 2 * sum(m * k * n for m, k, n in SHAPES.values())
    overall = {path: total / s / 1e9 for path, s in seconds.items()}
    print(f"{'all':10} {'(FLOP-weighted)':>18} " + " ".join(f"{overall[p]:12.1f}" for p in paths))
    bf16_onednn = overall.get("bf16 onednn", 0.0)
    print(f"fp32: onednn / torch {overall['fp32 onednn'] / overall['fp32 torch']:.2f}x; "
          f"bf16: onednn / torch {bf16_onednn / overall['bf16 torch']:.2f}x; "
          f"best bf16 / best fp32 {max(bf16_onednn, overall['bf16 torch']) / max(overall['fp32 onednn'], overall['fp32 torch']):.2f}x; "
          f"faster bf16 path here: {'onednn' if bf16_onednn > overall['bf16 torch'] else 'torch'}")


def fsdp_steps(repeats: int, layers: int) -> dict[str, float]:
    """Median ``forward_backward`` seconds: fp32 with each ``cpu_gemm``, and bf16 (``model.dtype``)."""
    import torch

    from skyrl_core.config.loader import structure_options
    from skyrl_core.config.schema import ModelConfig, TrainerConfig
    from skyrl_core.plugins.manager import get_plugin_manager
    from skyrl_core.types import TrainingBatch

    model = ModelConfig(config=smollm2_width(layers))
    ids = torch.randint(3, 49152, (ROWS, PROMPT + RESPONSE), generator=torch.Generator().manual_seed(0))
    batch = TrainingBatch(input_ids=ids, attention_mask=torch.ones_like(ids), loss_mask=torch.ones(ROWS, RESPONSE))

    def loss_fn(logprobs, batch):
        return -(logprobs * batch.loss_mask).sum() / batch.loss_mask.sum(), {}

    spec = get_plugin_manager().spec("training_backend", "fsdp")
    variants = {"fp32 torch": ("float32", "torch"), "fp32 onednn": ("float32", "onednn"), "bf16": ("bfloat16", "onednn")}
    backends = {
        name: spec.load_factory()(attrs.evolve(model, dtype=dtype), structure_options(spec, {"cpu_gemm": gemm}, path="fsdp"),
                                  seed=0, trainer=TrainerConfig(micro_batch_size=16))
        for name, (dtype, gemm) in variants.items()
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
    return {name: statistics.median(values) for name, values in times.items()}


def heap_child(repeats: int, layers: int) -> list[float]:
    """``forward_backward`` times of one oneDNN backend in this process (a child of ``main``)."""
    import torch

    from skyrl_core.config.loader import structure_options
    from skyrl_core.config.schema import ModelConfig, TrainerConfig
    from skyrl_core.plugins.manager import get_plugin_manager
    from skyrl_core.types import TrainingBatch

    model = ModelConfig(config=smollm2_width(layers))
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
    print(machine())
    print(f"threads {args.threads}")
    gemm_rates(args.repeats)
    roofline = Roofline(decoder_gemms(smollm2_width(args.layers), ROWS * (PROMPT + RESPONSE), ROWS * RESPONSE, backward=True),
                        threads=args.threads).measure()
    steps = fsdp_steps(args.repeats, args.layers)
    roofline.measure()  # again after the steps: the best of both
    print(f"FSDP forward_backward, {ROWS} x {PROMPT + RESPONSE} tokens, {args.layers} SmolLM2-width layers; {roofline.summary()}")
    for name, seconds in steps.items():
        print(roofline.achieved(f"  {name:11s}", seconds, "bfloat16" if name == "bf16" else "float32"))
    torch_s, onednn_s = steps["fp32 torch"], steps["fp32 onednn"]
    tuned, stock = heap_comparison(args)
    print(f"FSDP forward_backward (onednn) in child processes: tuned heap {tuned:.2f} s, "
          f"SKYRL_HEAP_TUNING=0 {stock:.2f} s, ratio {tuned / stock:.2f}")
    print(f"median step bf16 / faster fp32: {steps['bf16'] / min(torch_s, onednn_s):.2f}")
    print(f"median step onednn / torch: {onednn_s / torch_s:.2f}")


if __name__ == "__main__":
    main()
