"""IsoExec on vs off, side by side in one run: engine tokens/s, trainer step time, and the trainer
step with the old-logprob pass skipped (what a verified contract allows).

The model is a random Qwen3 of SmolLM2's width (hidden 576, 9/3 heads of 64, MLP 1536) with 4
layers and a 8192-token vocabulary (``--preset`` picks a tiny IsoExec preset instead,
``--smollm2`` the real SmolLM2-135M-Instruct: 30 layers, 49152 tokens, about 5 GB for the four
runtimes). The skyrl-torch engine samples
``--batch`` prompts (16-48 random tokens) for ``--max-new-tokens`` tokens; the FSDP trainer
(world size 1) then runs one step on those samples:

- ``step``: old-logprob forward (``backend.forward``) + ``forward_backward`` + ``optim_step``;
- ``step, skip``: the same without the old-logprob forward (old logprobs = rollout logprobs).

On and off alternate ``--repeats`` times after one warm-up each, so that a busy machine slows both
alike; medians are compared. Targets (issue 6): on/off <= 1.10x, and (on with skip)/(off) <= 1.0x.
Beside the times: the CPU, the GEMM libraries, and this machine's floor for each piece of work
(``benchmarks/_roofline.py``: the linear layers' products at the fastest rate measured at each
shape in this run, in ``--dtype``) with the fraction of that peak each reached.

    python benchmarks/isoexec_on_off.py [--preset qwen3 | --smollm2] [--repeats 3] [--threads 2] [--batch 16]
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

from _roofline import Roofline, decoder_gemms, generation_gemms, machine


BENCH_MODEL = {
    "model_type": "qwen3", "hidden_size": 576, "intermediate_size": 1536, "num_hidden_layers": 4,
    "num_attention_heads": 9, "num_key_value_heads": 3, "head_dim": 64, "vocab_size": 8192,
    "max_position_embeddings": 1024, "tie_word_embeddings": True,
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--preset", default=None, help="a tiny IsoExec preset family instead")
    parser.add_argument("--smollm2", action="store_true", help="SmolLM2-135M-Instruct instead")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--max-new-tokens", type=int, default=32)
    args = parser.parse_args()

    import attrs
    import torch

    from skyrl_core.config.schema import ModelConfig, TrainerConfig
    from skyrl_core.types import GenerationRequest, SamplingParams
    from skyrl_isoexec import state
    from skyrl_isoexec.verify import build_runtime, training_batch

    torch.set_num_threads(args.threads)
    if args.preset:
        from skyrl_isoexec.presets import preset

        model = ModelConfig(config=preset(args.preset), dtype=args.dtype)
        name = f"preset {args.preset}"
    elif args.smollm2:
        from skyrl_core.models import prepare_smollm2

        model = ModelConfig(path=prepare_smollm2(), dtype=args.dtype)
        name = "SmolLM2-135M-Instruct"
    else:
        model = ModelConfig(config=BENCH_MODEL, dtype=args.dtype)
        name = "Qwen3 576x4 (random)"
    runtimes = {}
    for label, on in (("off", False), ("on", True)):
        with state.enabled_scope(on):
            trainer = build_runtime(
                "training_backend", "fsdp",
                {"device": "cpu", "mixed_precision": "bf16" if args.dtype == "bfloat16" else "fp32"},
                model, seed=0, trainer=TrainerConfig(micro_batch_size=args.batch, lr=1e-6),
            )
            engine = build_runtime("inference_engine", "torch", {"max_num_seqs": args.batch}, model, seed=0)
            engine.update_weights(trainer.export_weights())
            runtimes[label] = (engine, trainer)
    # Off, but through the transformers modules IsoExec patches (skyrl-torch's lean native decoder
    # only runs stock ops): separates the cost of the canonical kernels from that of the module path.
    modules_engine = build_runtime(
        "inference_engine", "torch", {"max_num_seqs": args.batch, "implementation": "transformers"}, model, seed=0
    )
    modules_engine.update_weights(runtimes["off"][1].export_weights())
    vocab = runtimes["on"][0].vocab_size
    rng = random.Random(0)
    prompts = [[rng.randrange(3, vocab) for _ in range(rng.randint(16, 48))] for _ in range(args.batch)]

    def generate(engine, seed: int, max_new: int):
        requests = [
            GenerationRequest(request_id=str(i), prompt_token_ids=p,
                              sampling=SamplingParams(max_tokens=max_new, seed=seed * 1000 + i, stop_token_ids=()))
            for i, p in enumerate(prompts)
        ]
        return [s for group in engine.generate(requests) for s in group]

    def loss_fn(logprobs, micro):
        mask = micro.loss_mask
        ratio = torch.exp(logprobs - micro.old_logprobs)
        return -(ratio * mask).sum() / mask.sum().clamp(min=1), {}

    def train_step(trainer, samples, skip: bool) -> float:
        batch = training_batch(samples)
        rollout = torch.zeros(batch.loss_mask.shape)
        for i, s in enumerate(samples):
            rollout[i, : len(s.logprobs)] = torch.tensor(s.logprobs)
        started = time.perf_counter()
        old = rollout if skip else trainer.forward(batch)
        trainer.forward_backward(attrs.evolve(batch, old_logprobs=old), loss_fn)
        trainer.optim_step()
        return time.perf_counter() - started

    print(f"{name} {args.dtype}, batch {args.batch}, {args.max_new_tokens} new tokens, {args.threads} threads", flush=True)
    for label in ("off", "on"):  # warm-up
        engine, trainer = runtimes[label]
        with state.enabled_scope(label == "on"):
            train_step(trainer, generate(engine, 0, 4), skip=False)
    generate(modules_engine, 0, 4)
    times: dict[str, list[float]] = {
        k: [] for k in ("gen off", "gen off, modules", "gen on", "step off", "step on", "step on, skip")
    }
    for rep in range(args.repeats):
        for label in ("off", "on"):
            engine, trainer = runtimes[label]
            with state.enabled_scope(label == "on"):
                started = time.perf_counter()
                samples = generate(engine, rep + 1, args.max_new_tokens)
                seconds = time.perf_counter() - started
                times[f"gen {label}"].append(sum(len(s.token_ids) for s in samples) / seconds)
                times[f"step {label}"].append(train_step(trainer, samples, skip=False))
                if label == "on":
                    times["step on, skip"].append(train_step(trainer, samples, skip=True))
            if label == "off":
                started = time.perf_counter()
                tokens = sum(len(s.token_ids) for s in generate(modules_engine, rep + 1, args.max_new_tokens))
                times["gen off, modules"].append(tokens / (time.perf_counter() - started))
            print(f"repeat {rep} {label:3s}: engine {times[f'gen {label}'][-1]:8.1f} tokens/s, "
                  f"step {times[f'step {label}'][-1]:6.2f} s"
                  + (f", step with skip {times['step on, skip'][-1]:6.2f} s" if label == "on" else
                     f", engine through the transformers modules {times['gen off, modules'][-1]:8.1f} tokens/s"),
                  flush=True)
    med = {k: statistics.median(v) for k, v in times.items()}
    print(f"median engine tokens/s: off {med['gen off']:.1f} (native decoder), "
          f"off {med['gen off, modules']:.1f} (transformers modules), on {med['gen on']:.1f}")
    print(f"engine time ratio on/off: {med['gen off'] / med['gen on']:.2f}x vs the native decoder, "
          f"{med['gen off, modules'] / med['gen on']:.2f}x vs the same transformers modules")
    print(f"median trainer step: off {med['step off']:.2f} s, on {med['step on']:.2f} s  "
          f"(ratio on/off {med['step on'] / med['step off']:.2f}x)")
    print(f"median trainer step, old-logprob pass skipped: on {med['step on, skip']:.2f} s  "
          f"(net ratio vs off {med['step on, skip'] / med['step off']:.2f}x)")
    config = runtimes["off"][0].model.config
    prompt_tokens, response_tokens = sum(map(len, prompts)), args.batch * args.max_new_tokens
    sampling = generation_gemms(config, prompt_tokens, response_tokens, args.batch, args.max_new_tokens)
    training = decoder_gemms(config, prompt_tokens + response_tokens, response_tokens, backward=True)
    scoring = decoder_gemms(config, prompt_tokens + response_tokens, response_tokens)
    roofline = Roofline(sampling + training + scoring, threads=args.threads).measure()
    print(machine())
    print(roofline.summary())
    for label in ("gen off", "gen off, modules", "gen on"):
        print(roofline.part(sampling).achieved(f"  engine {label[4:]:13s}", response_tokens / med[label], args.dtype))
    for label in ("step off", "step on"):
        print(roofline.part(training + scoring).achieved(f"  trainer {label[5:]:12s}", med[label], args.dtype))
    print(roofline.part(training).achieved("  trainer on, skip   ", med["step on, skip"], args.dtype))
    modules_engine.close()
    for engine, trainer in runtimes.values():
        engine.close()
        trainer.close()


if __name__ == "__main__":
    main()
