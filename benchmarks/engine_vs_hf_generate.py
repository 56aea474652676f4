"""Rollout throughput: skyrl-torch vs Hugging Face ``generate``, side by side in one run.

SmolLM2-135M-Instruct (fp32, converted by ``skyrl_core.models.prepare_smollm2``), a batch of 64
chat-templated prompts "What is a + b?" (a, b in 0..49), up to 32 new tokens sampled at
temperature 1 (no top-k/top-p), stopping at EOS, on 2 intra-op threads. The two engines run
alternately, ``--repeats`` times each after one warm-up, so that a busy machine slows both alike.

Tokens/s counts generated tokens up to and including EOS (never padding). The last line is the
ratio of the median tokens/s (skyrl-torch / HF generate). The CPU seconds each run consumed are
printed too: on a machine shared with other work, wall time swings with their load, CPU time less.
Beside them: the CPU, the GEMM libraries, and this machine's floor for the work
(``benchmarks/_roofline.py``: the linear layers' products of the prefill and of every decode step,
at the fastest rate measured at each shape in this run) with the fraction of that peak each reached.

    python benchmarks/engine_vs_hf_generate.py [--repeats 3] [--threads 2] [--batch 64]
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

from _roofline import generation_gemms, machine, model_config_dict, rollout_roofline, total_flops


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--max-new-tokens", type=int, default=32)
    args = parser.parse_args()

    import torch
    from transformers import AutoModelForCausalLM

    from skyrl_core.config.schema import ModelConfig
    from skyrl_core.models import load_tokenizer, prepare_smollm2
    from skyrl_core.types import GenerationRequest, SamplingParams
    from skyrl_torch.engine import TorchEngine
    from skyrl_torch.options import TorchEngineOptions

    torch.set_num_threads(args.threads)
    model_dir = prepare_smollm2()
    model_config = ModelConfig(path=model_dir)
    tokenizer = load_tokenizer(model_config)
    rng = random.Random(0)
    questions = [f"What is {rng.randint(0, 49)} + {rng.randint(0, 49)}?" for _ in range(args.batch)]
    prompts = [
        tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, tokenize=False)
        for q in questions
    ]
    prompt_ids = [tokenizer(p, add_special_tokens=False)["input_ids"] for p in prompts]
    eos = tokenizer.eos_token_id

    hf_model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    tokenizer.padding_side = "left"
    hf_inputs = tokenizer(prompts, return_tensors="pt", padding=True, add_special_tokens=False)
    engine = TorchEngine(model_config, TorchEngineOptions(max_num_seqs=args.batch), seed=0)

    def run_hf(seed: int, max_new: int) -> int:
        torch.manual_seed(seed)
        with torch.inference_mode():
            out = hf_model.generate(
                **hf_inputs, max_new_tokens=max_new, do_sample=True, temperature=1.0, top_k=0, top_p=1.0,
                pad_token_id=tokenizer.pad_token_id, eos_token_id=eos,
            )
        generated = out[:, hf_inputs["input_ids"].shape[1] :].tolist()
        return sum(row.index(eos) + 1 if eos in row else len(row) for row in generated)

    def run_skyrl(seed: int, max_new: int) -> int:
        requests = [
            GenerationRequest(
                request_id=str(i), prompt_token_ids=p, sampling=SamplingParams(max_tokens=max_new, seed=seed * 1000 + i)
            )
            for i, p in enumerate(prompt_ids)
        ]
        return sum(len(s.token_ids) for group in engine.generate(requests) for s in group)

    contract = engine.execution_contract()
    print(
        f"SmolLM2-135M-Instruct fp32, batch {args.batch}, {args.max_new_tokens} new tokens, {torch.get_num_threads()} "
        f"threads, prompts of {min(map(len, prompt_ids))}-{max(map(len, prompt_ids))} tokens; skyrl-torch "
        f"implementation {contract['implementation']}, gemm {contract['gemm']}",
        flush=True,
    )
    run_hf(0, 2)
    run_skyrl(0, 2)
    rates: dict[str, list[float]] = {"hf_generate": [], "skyrl_torch": []}
    cpu_rates: dict[str, list[float]] = {"hf_generate": [], "skyrl_torch": []}
    counts: dict[str, list[int]] = {"hf_generate": [], "skyrl_torch": []}
    for rep in range(args.repeats):
        for name, fn in (("hf_generate", run_hf), ("skyrl_torch", run_skyrl)):
            start, cpu_start = time.perf_counter(), time.process_time()
            tokens = fn(rep + 1, args.max_new_tokens)
            seconds, cpu_seconds = time.perf_counter() - start, time.process_time() - cpu_start
            rates[name].append(tokens / seconds)
            counts[name].append(tokens)
            cpu_rates[name].append(tokens / cpu_seconds)
            print(
                f"repeat {rep}  {name:12s} {tokens:5d} tokens in {seconds:7.2f} s (CPU {cpu_seconds:7.2f} s) "
                f"= {tokens / seconds:8.1f} tokens/s",
                flush=True,
            )
    hf, skyrl = statistics.median(rates["hf_generate"]), statistics.median(rates["skyrl_torch"])
    hf_cpu, skyrl_cpu = statistics.median(cpu_rates["hf_generate"]), statistics.median(cpu_rates["skyrl_torch"])
    print(f"median tokens per CPU second: hf_generate {hf_cpu:.1f}, skyrl_torch {skyrl_cpu:.1f} ({skyrl_cpu / hf_cpu:.2f}x)", flush=True)
    print(f"median tokens/s: hf_generate {hf:.1f}, skyrl_torch {skyrl:.1f}", flush=True)
    print(machine())
    config, prompt_tokens = model_config_dict(model_config), [len(p) for p in prompt_ids]
    generated = {name: round(statistics.median(c)) for name, c in counts.items()}
    roofline = rollout_roofline(config, prompt_tokens, round(statistics.mean(generated.values())), args.max_new_tokens,
                                threads=args.threads)
    print(roofline.summary())
    for name, rate in (("hf_generate", hf), ("skyrl_torch", skyrl)):
        own = total_flops(generation_gemms(config, sum(prompt_tokens), generated[name], len(prompt_tokens), args.max_new_tokens))
        print(roofline.achieved(f"  {name:12s} a run of {generated[name]} tokens", generated[name] / rate, "float32", flops=own))
    print(f"skyrl-torch / HF generate rollout tokens/s ratio: {skyrl / hf:.2f}x", flush=True)


if __name__ == "__main__":
    main()
