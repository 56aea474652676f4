"""The ``openai`` inference engine: any OpenAI-compatible completions server, by URL.

Prompts go in as token ids (the completions API accepts a list of integers as ``prompt``); token
ids and logprobs come back through vLLM's extensions ``return_token_ids`` (``choices[].token_ids``)
and ``return_tokens_as_token_ids`` (``logprobs.tokens`` as ``"token_id:N"``), with ``logprobs=1``
for the sampled tokens' logprobs. A server that returns neither cannot serve RL rollouts; the
engine says so on the first response.

Weight sync needs a server we control: with ``launch: true`` the engine starts ``vllm serve`` on
127.0.0.1 with its development endpoints and skyrl's worker extension, and ``update_weights``
writes a safetensors file and calls ``/collective_rpc`` + ``/reset_prefix_cache``. A server given
by ``base_url`` is generation-only.
"""

from __future__ import annotations

import concurrent.futures
import logging
import os
import weakref
from typing import TYPE_CHECKING, Any, Iterable, Sequence

import attrs

from skyrl_core.engine_pause import PauseNotSupported
from skyrl_core.engines.lifecycle import temporary_workdir
from skyrl_core.engines.requests import check_request
from skyrl_core.types import GeneratedSample, GenerationRequest, SamplingParams
from skyrl_vllm.mapping import is_greedy, stop_reason
from skyrl_vllm.options import OpenAIOptions

if TYPE_CHECKING:
    import torch

    from skyrl_core.config.schema import ModelConfig

logger = logging.getLogger(__name__)

TOKEN_ID_PREFIX = "token_id:"


def completion_body(model_name: str, request: GenerationRequest) -> dict[str, Any]:
    """The JSON body of ``POST /v1/completions`` for one request (all ``n`` samples; one when greedy,
    since vLLM refuses ``n > 1`` then and ``samples_from_response`` repeats it)."""
    s: SamplingParams = request.sampling
    body: dict[str, Any] = {
        "model": model_name,
        "prompt": list(request.prompt_token_ids),
        "n": 1 if is_greedy(s) else s.n,
        "max_tokens": s.max_tokens,
        "temperature": s.temperature,
        "top_p": s.top_p,
        "top_k": s.top_k,
        "logprobs": 1,
        "return_token_ids": True,
        "return_tokens_as_token_ids": True,
        "skip_special_tokens": True,
    }
    if s.seed is not None:
        body["seed"] = s.seed
    if s.stop:
        body["stop"] = list(s.stop)
    if s.stop_token_ids:
        body["stop_token_ids"] = list(s.stop_token_ids)
    return body


def _choice_token_ids(choice: dict[str, Any], request_id: str) -> list[int]:
    if choice.get("token_ids") is not None:
        return [int(t) for t in choice["token_ids"]]
    tokens = (choice.get("logprobs") or {}).get("tokens") or []
    if tokens and all(isinstance(t, str) and t.startswith(TOKEN_ID_PREFIX) for t in tokens):
        return [int(t[len(TOKEN_ID_PREFIX) :]) for t in tokens]
    raise RuntimeError(
        f"request {request_id!r}: the server returned no token ids (neither choices[].token_ids nor "
        f"'token_id:N' logprob tokens); the openai engine needs a server with vLLM's return_token_ids "
        "or return_tokens_as_token_ids extension"
    )


def samples_from_response(request: GenerationRequest, response: dict[str, Any]) -> list[GeneratedSample]:
    """The ``n`` samples of one completions response, in choice-index order."""
    samples = []
    for choice in sorted(response.get("choices", []), key=lambda c: c["index"]):
        token_ids = _choice_token_ids(choice, request.request_id)
        logprobs = (choice.get("logprobs") or {}).get("token_logprobs")
        if logprobs is None or len(logprobs) != len(token_ids) or any(lp is None for lp in logprobs):
            raise RuntimeError(
                f"request {request.request_id!r}: the server returned {0 if logprobs is None else len(logprobs)} "
                f"logprobs for {len(token_ids)} tokens"
            )
        samples.append(
            GeneratedSample(
                request_id=request.request_id,
                sample_index=int(choice["index"]),
                prompt_token_ids=request.prompt_token_ids,
                token_ids=token_ids,
                logprobs=[float(lp) for lp in logprobs],
                text=choice.get("text") or "",
                stop_reason=stop_reason(choice.get("finish_reason"), request.request_id),
            )
        )
    if is_greedy(request.sampling) and len(samples) == 1:
        samples += [attrs.evolve(samples[0], sample_index=j) for j in range(1, request.sampling.n)]
    if len(samples) != request.sampling.n:
        raise RuntimeError(f"request {request.request_id!r}: asked for {request.sampling.n} samples, got {len(samples)}")
    return samples


class OpenAIEngine(PauseNotSupported):
    """``InferenceEngine`` over an OpenAI-compatible completions endpoint."""

    def __init__(self, model: ModelConfig, options: OpenAIOptions | None = None, *, seed: int = 0) -> None:
        import httpx

        if options is None:
            raise ValueError("the openai engine needs options: base_url (an existing server) or launch: true")
        self.options = options
        self.seed = seed
        self._server: Any = None
        self._workdir: str | None = None
        self.sleep_supported = False
        self._asleep = False
        headers = {"Authorization": f"Bearer {options.api_key}"} if options.api_key else {}
        self._http = httpx.Client(headers=headers, timeout=options.request_timeout_s)
        try:
            if options.launch:
                self._launch(model)
            else:
                self.root_url = options.base_url.rstrip("/").removesuffix("/v1")
                self.model_name = options.model_name or self._first_served_model()
        except BaseException:
            self.close()
            raise

    def _launch(self, model: ModelConfig) -> None:
        from vllm.platforms import current_platform

        from skyrl_core.engines.model_dir import checkpoint_shapes, materialize_model, checkpoint_ties_unembedding
        from skyrl_core.ports import on_a_free_port
        from skyrl_vllm.vllm_server import SERVED_MODEL_NAME, VLLMServer, serve_command

        self.sleep_supported = bool(current_platform.is_sleep_mode_available())
        self._workdir, self._remove_workdir = temporary_workdir(self, "skyrl-vllm-serve-")
        model_dir, tokenizer_dir = materialize_model(model, seed=self.seed, parent_dir=self._workdir)
        self._weight_shapes = checkpoint_shapes(model_dir)
        self._ties_unembedding = checkpoint_ties_unembedding(model_dir)
        vopts = self.options.vllm

        def serve_on(port: int) -> VLLMServer:
            cmd = serve_command(model_dir, tokenizer_dir, vopts, dtype=vopts.dtype or model.dtype, seed=self.seed,
                                port=port, enable_sleep_mode=self.sleep_supported)
            server = VLLMServer(cmd, log_path=os.path.join(self._workdir, f"vllm-serve-{port}.log"))
            try:
                server.wait_ready(self.options.startup_timeout_s)
            except BaseException:
                server.stop()
                raise
            return server

        self._server = on_a_free_port(serve_on)  # again on another port if one was taken meanwhile
        # close() stops it; so does interpreter exit if the engine is never closed.
        self._stop_server = weakref.finalize(self, self._server.stop)
        self.root_url = self._server.base_url
        self.model_name = SERVED_MODEL_NAME

    # -- InferenceEngine ----------------------------------------------------------------------------

    def generate(self, requests: Sequence[GenerationRequest]) -> list[list[GeneratedSample]]:
        self._check_usable()
        for request in requests:
            check_request(request)
        if not requests:
            return []
        workers = min(self.options.max_concurrency, len(requests))
        with concurrent.futures.ThreadPoolExecutor(max_workers=workers) as pool:
            return list(pool.map(self._complete, requests))

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        self._check_usable()
        if self._server is None:
            raise NotImplementedError(
                f"the openai engine cannot update weights of the server at {self.root_url}: only a server it "
                "launched itself (options.launch: true) accepts weights"
            )
        from skyrl_core.engines.model_dir import checked_weights, write_weights_file

        named = checked_weights(named_tensors, self._weight_shapes, to_cpu=True, tied=self._ties_unembedding)
        path = write_weights_file(named, self._workdir)
        try:
            loaded = self._rpc("skyrl_load_weights", path)
        finally:
            os.remove(path)
        if any(int(n) != len(named) for n in loaded):
            raise RuntimeError(f"vLLM workers loaded {loaded} tensors, expected {len(named)}")
        self._post("/reset_prefix_cache")

    def execution_contract(self) -> dict[str, Any]:
        self._check_usable()
        contract: dict[str, Any] = {"engine": "openai", "model": self.model_name}
        if self._server is None:
            # A foreign server's numerics are unknown: an empty ledger, so a handshake cannot pass silently.
            contract.update(ledger={}, base_url=self.root_url)
            return contract
        workers = list(self._rpc("skyrl_attest"))
        contract.update(ledger=workers[0].get("ledger", {}), launched="vllm serve", workers=workers)
        return contract

    def sleep(self) -> None:
        """Free a launched server's memory where vLLM has sleep mode (GPU); otherwise log and keep it."""
        self._check_usable()
        if self._server is not None and self.sleep_supported:
            self._post("/sleep", params={"level": self.options.vllm.sleep_level})
        else:
            logger.warning("the openai engine's server cannot sleep here: sleep() keeps its memory allocated")
        self._asleep = True

    def wake(self) -> None:
        if not self._asleep:
            return
        if self._server is not None and self.sleep_supported:
            self._post("/wake_up")
        self._asleep = False

    def close(self) -> None:
        """Stop a launched server (all its processes) and free the HTTP client; idempotent."""
        if self._server is not None:
            self._stop_server()
            self._server = None
        if getattr(self, "_http", None) is not None:
            self._http.close()
            self._http = None
        if self._workdir is not None:
            self._remove_workdir()
            self._workdir = None

    def __enter__(self) -> OpenAIEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- HTTP ---------------------------------------------------------------------------------------

    def _check_usable(self) -> None:
        if self._http is None:
            raise RuntimeError("this openai engine is closed")

    def _complete(self, request: GenerationRequest) -> list[GeneratedSample]:
        if self._asleep:
            raise RuntimeError("this openai engine is asleep; call wake() first")
        response = self._http.post(self.root_url + "/v1/completions", json=completion_body(self.model_name, request))
        if response.status_code != 200:
            raise RuntimeError(
                f"request {request.request_id!r}: {self.root_url}/v1/completions answered "
                f"{response.status_code}: {response.text[:500]}"
            )
        return samples_from_response(request, response.json())

    def _first_served_model(self) -> str:
        response = self._http.get(self.root_url + "/v1/models")
        response.raise_for_status()
        models = response.json().get("data") or []
        if not models:
            raise RuntimeError(f"the server at {self.root_url} lists no models; set options.model_name")
        return str(models[0]["id"])

    def _post(self, path: str, *, params: dict[str, Any] | None = None) -> None:
        """POST one of the launched server's dev endpoints; raise with its answer unless 200."""
        response = self._http.post(self.root_url + path, params=params)
        if response.status_code != 200:
            raise RuntimeError(f"{self.root_url}{path} answered {response.status_code}: {response.text[:500]}")

    def _rpc(self, method: str, *args: str) -> list[Any]:
        """Call a worker-extension method in every worker of the launched server."""
        response = self._http.post(self.root_url + "/collective_rpc", json={"method": method, "args": list(args)})
        if response.status_code != 200:
            raise RuntimeError(
                f"{self.root_url}/collective_rpc {method} answered {response.status_code}: {response.text[:500]}"
            )
        return list(response.json().get("results") or [])
