"""Training step time: skyrl-megatron beside skyrl-fsdp on the same work, in one run.

A Qwen3-architecture model built from a config (hidden 256, 4 layers, 4 heads / 2 KV heads, FFN
768, vocabulary 4096; ~4M parameters, fp32), a batch of 8 sequences (prompts of 32-64 tokens,
left-padded; responses of 48-96 tokens, right-padded), micro-batches of 4. One step is
``forward`` (old logprobs) + ``forward_backward`` (token-mean negative logprob) + ``optim_step``.
Both backends run in this process (``--processes 1``) or as two Ray actors each (``--processes 2``:
Megatron tensor parallel 2 beside FSDP world size 2), alternately, ``--repeats`` steps each after
one warm-up step, so that a busy machine slows both alike.

The last line is the ratio of median step times (Megatron / FSDP); below 1 means Megatron is faster.
Beside them: the CPU, the GEMM libraries, and this machine's floor for one step
(``benchmarks/_roofline.py``: the linear layers' products of the forward and of the forward and
backward, logits on the response positions, at the fastest fp32 rate measured at each shape in
this run on the threads the step uses) with the fraction of that peak each backend reached.

    python benchmarks/megatron_vs_fsdp.py [--repeats 3] [--processes 1] [--threads 1]
"""

from __future__ import annotations

import argparse
import statistics
import time

from _roofline import Roofline, decoder_gemms, machine

MODEL = {
    "model_type": "qwen3",
    "hidden_size": 256,
    "intermediate_size": 768,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "vocab_size": 4096,
    "max_position_embeddings": 512,
    "tie_word_embeddings": True,
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--processes", type=int, default=1, choices=(1, 2))
    # One thread: on a shared, loaded machine more threads mostly measure contention.
    parser.add_argument("--threads", type=int, default=1, help="torch threads in this process (--processes 1)")
    args = parser.parse_args()

    import os
    import warnings

    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    warnings.filterwarnings("ignore")
    import torch

    from skyrl_core.config.schema import ModelConfig, TrainerConfig
    from skyrl_core.testing.backend_contract import make_batch, mean_logprob_loss, random_sequences
    from skyrl_fsdp.backend import FSDPBackend
    from skyrl_fsdp.options import FSDPOptions
    from skyrl_megatron.backend import MegatronBackend
    from skyrl_megatron.options import MegatronOptions

    torch.set_num_threads(args.threads)
    gen = torch.Generator().manual_seed(0)
    prompt_lengths = tuple(int(n) for n in torch.randint(32, 65, (8,), generator=gen))
    response_lengths = tuple(int(n) for n in torch.randint(48, 97, (8,), generator=gen))
    batch = make_batch(*random_sequences(prompt_lengths, response_lengths, vocab_size=MODEL["vocab_size"]))
    model = ModelConfig(config=dict(MODEL))
    trainer = TrainerConfig(lr=1e-4, micro_batch_size=4, steps=100)

    # FSDP first: with one process it creates the process group that Megatron then joins.
    fsdp = FSDPBackend(model, FSDPOptions(world_size=args.processes, device="cpu"), trainer=trainer)
    megatron = MegatronBackend(model, MegatronOptions(tensor_parallel=args.processes, device="cpu"), trainer=trainer)
    backends = {"megatron": megatron, "fsdp": fsdp}

    def step(backend) -> float:
        start = time.perf_counter()
        backend.forward(batch)
        backend.forward_backward(batch, mean_logprob_loss)
        backend.optim_step()
        return time.perf_counter() - start

    times: dict[str, list[float]] = {name: [] for name in backends}
    try:
        for name, backend in backends.items():
            step(backend)  # warm-up
        for _ in range(args.repeats):
            for name, backend in backends.items():
                times[name].append(step(backend))
    finally:
        megatron.close()
        fsdp.close()

    layout = f"tensor parallel {args.processes}" if args.processes > 1 else "1 process"
    print(f"{sum(response_lengths)} response tokens/step, {args.repeats} steps each after a warm-up")
    for name, values in times.items():
        where = layout if name == "megatron" else f"world size {args.processes}"
        print(f"{name:9s} ({where}): median {statistics.median(values):.3f} s/step  [{', '.join(f'{v:.3f}' for v in values)}]")
    tokens, responses = sum(prompt_lengths) + sum(response_lengths), sum(response_lengths)
    gemms = decoder_gemms(MODEL, tokens, responses) + decoder_gemms(MODEL, tokens, responses, backward=True)
    threads = args.threads if args.processes == 1 else (os.cpu_count() or args.processes)
    roofline = Roofline(gemms, threads=threads).measure()
    print(machine())
    print(roofline.summary())
    for name, values in times.items():
        print(roofline.achieved(f"  {name:9s} median step", statistics.median(values), "float32"))
    ratio = statistics.median(times["megatron"]) / statistics.median(times["fsdp"])
    print(f"step time ratio megatron/fsdp: {ratio:.2f}")


if __name__ == "__main__":
    main()
