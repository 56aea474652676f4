"""The ``sglang`` inference engine: skyrl's ``InferenceEngine`` over SGLang's offline ``Engine`` API."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Iterable, Sequence

from skyrl_core.engine_pause import PauseNotSupported
from skyrl_core.engines.lifecycle import environ, running, temporary_workdir
from skyrl_core.engines.requests import check_request
from skyrl_sglang import bootstrap
from skyrl_sglang.mapping import flatten, gather
from skyrl_sglang.options import SGLangOptions

if TYPE_CHECKING:
    import torch

    from skyrl_core.config.schema import ModelConfig
    from skyrl_core.types import GeneratedSample, GenerationRequest

# The one sentence a machine without CUDA gets (tests compare it exactly).
CUDA_REQUIRED = (
    "The sglang engine needs an NVIDIA GPU with CUDA and this machine has none; "
    "use engine.name=vllm or engine.name=torch here."
)
SGLANG_MISSING = "The sglang engine needs the sglang package: pip install 'skyrl-sglang[gpu]'."


class EngineUnavailableError(RuntimeError):
    """The engine cannot run on this machine (no CUDA, or SGLang not installed)."""


def check_available() -> None:
    """Raise ``EngineUnavailableError`` with one clear sentence unless SGLang can start here."""
    import importlib.util

    import torch

    if not torch.cuda.is_available():
        raise EngineUnavailableError(CUDA_REQUIRED)
    if importlib.util.find_spec("sglang") is None:
        raise EngineUnavailableError(SGLANG_MISSING)


class SGLangEngine(PauseNotSupported):
    """Generates with ``sglang.Engine``; weights update in place with ``update_weights_from_tensor``.

    Before starting SGLang the engine sets ``SKYRL_SGLANG_WORKER=1`` (skyrl's bootstrap then runs in
    every SGLang process) and ``SGLANG_RETURN_ORIGINAL_LOGPROB=1``, so that returned logprobs are
    taken before temperature scaling, as ``GeneratedSample.logprobs`` promises.
    """

    def __init__(self, model: ModelConfig, options: SGLangOptions | None = None, *, seed: int = 0) -> None:
        check_available()
        problem = bootstrap.sglang_plugins_allowlist_problem()
        if problem is not None:
            raise ValueError(f"cannot start the sglang engine: {problem}")
        self.options = options or SGLangOptions()
        self.seed = seed
        self.dtype = self.options.dtype or model.dtype
        self._engine: Any = None
        self._asleep = False
        self._workdir, self._remove_workdir = temporary_workdir(self, "skyrl-sglang-")
        try:
            self._start(model)
        except BaseException:
            self.close()
            raise

    def _start(self, model: ModelConfig) -> None:
        import sglang

        from skyrl_core.ops import prepare_model
        from skyrl_core.engines.model_dir import checkpoint_shapes, materialize_model, checkpoint_ties_unembedding

        self.sglang_version = sglang.__version__
        model_dir, tokenizer_dir = materialize_model(model, seed=self.seed, parent_dir=self._workdir)
        self._weight_shapes = checkpoint_shapes(model_dir)
        self._ties_unembedding = checkpoint_ties_unembedding(model_dir)
        kwargs: dict[str, Any] = {
            "model_path": model_dir,
            "tokenizer_path": tokenizer_dir or model_dir,
            "dtype": self.dtype,
            "random_seed": self.seed,
            "mem_fraction_static": self.options.mem_fraction_static,
            "enable_deterministic_inference": self.options.deterministic,
            "enable_memory_saver": self.options.enable_memory_saver,
            "log_level": "error",
        }
        if self.options.context_length is not None:
            kwargs["context_length"] = self.options.context_length
        if self.options.max_running_requests is not None:
            kwargs["max_running_requests"] = self.options.max_running_requests
        kwargs.update(self.options.engine_kwargs)
        env = {
            bootstrap.MARKER: "1",
            # Logprobs before temperature (the name changed across SGLang versions; set both).
            "SGLANG_RETURN_ORIGINAL_LOGPROB": "1",
            "RETURN_ORIGINAL_LOGPROB": "True",
        }
        with environ(**env):
            bootstrap.register()  # this process too: SGLang loads plugins once per process
            self._engine = sglang.Engine(**kwargs)
        # SGLang's RPC returns no values, so the ledger is declared here, where the same plugins and
        # environment decide the same implementations as in SGLang's scheduler processes.
        self._ledger = prepare_model(None, "engine")

    # -- InferenceEngine ----------------------------------------------------------------------------

    def generate(self, requests: Sequence[GenerationRequest]) -> list[list[GeneratedSample]]:
        engine = self._running()
        if not requests:
            return []
        for request in requests:
            check_request(request)
        input_ids, params, owners = flatten(requests)
        outputs = engine.generate(input_ids=input_ids, sampling_params=params, return_logprob=True)
        if isinstance(outputs, dict):
            outputs = [outputs]
        return gather(requests, owners, outputs)

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load the trainer's weights (HF names) in place and flush SGLang's prefix (radix) cache."""
        from skyrl_core.engines.model_dir import checked_weights

        engine = self._running()
        tensors = checked_weights(named_tensors, self._weight_shapes, tied=self._ties_unembedding)  # a bad name inside SGLang's scheduler is fatal
        result = engine.update_weights_from_tensor(named_tensors=tensors, flush_cache=True)
        success, message = (result if isinstance(result, tuple) else (True, ""))[:2]
        if not success:
            raise RuntimeError(f"SGLang refused the weight update: {message}")

    def execution_contract(self) -> dict[str, Any]:
        self._running()
        return {
            "ledger": self._ledger.as_dict(),
            "engine": "sglang",
            "sglang": self.sglang_version,
            "dtype": self.dtype,
            "device": "cuda",
            "deterministic": self.options.deterministic,
        }

    def sleep(self) -> None:
        """Release the GPU memory of ``options.sleep_tags`` (default: the KV cache) until ``wake``."""
        engine = self._running()
        engine.release_memory_occupation(tags=list(self.options.sleep_tags))
        self._asleep = True

    def wake(self) -> None:
        if self._engine is None or not self._asleep:
            return
        self._engine.resume_memory_occupation(tags=list(self.options.sleep_tags))
        self._asleep = False

    def close(self) -> None:
        """Shut SGLang's processes down and remove temporary files; idempotent."""
        engine, self._engine = self._engine, None
        if engine is not None:
            engine.shutdown()
        self._remove_workdir()

    def __enter__(self) -> SGLangEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _running(self) -> Any:
        return running(self._engine, asleep=self._asleep, engine="sglang")
