"""vLLM's ``AsyncLLM`` driven from ordinary threads: the engine behind ``VLLMEngine``'s pause/resume.

``AsyncLLM`` (its engine core and worker in their own processes) lives on an asyncio loop that runs
in a background thread of this process; every call here submits a coroutine to that loop and waits
for it, so ``generate`` may be called from several threads at once (their requests are batched
together by vLLM's scheduler) while another thread pauses, loads weights and resumes.

``pause`` uses vLLM's ``pause_generation(mode="keep", clear_cache=False)``: the engine core stops
scheduling between two steps and keeps every request, with its KV blocks, until
``resume_generation``. vLLM labels each step's tokens with the weight version set at that step
(``update_weight_version``, changed here only while paused) and reports per-token spans of those
labels on each finished completion (``CompletionOutput.weight_versions``): tokens from before the
pause carry the old label, those after carry the new one, exactly.

Requests ask for ``DELTA`` outputs (each step's new tokens only) and the driver puts each sample
back together; how far each unfinished sample has got is ``in_flight()``.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import threading
from typing import Any, Sequence

# Event-loop turns with vLLM's client-side output queue empty after which every output from before
# a pause has reached the per-request consumers below (vLLM's output handler takes a batch in one
# turn and hands it to the requests' collectors; a consumer wakes one or two turns later).
_SETTLE_TURNS = 8


class _Sample:
    """One sample put back together from vLLM's ``DELTA`` outputs (each: the tokens of a step or
    a few, their logprobs and text; the last one also the finish reason and the weight-version
    spans, which vLLM gives for the whole sample)."""

    def __init__(self) -> None:
        self.token_ids: list[int] = []
        self.logprobs: list[Any] | None = None  # None: vLLM sent none
        self.text: list[str] = []
        self.last: Any = None

    def add(self, delta: Any) -> None:
        self.token_ids.extend(delta.token_ids)
        if delta.logprobs is not None:
            if self.logprobs is None:
                self.logprobs = []
            self.logprobs.extend(delta.logprobs)
        self.text.append(delta.text)
        self.last = delta

    def completion(self, request_id: str) -> Any:
        """The whole sample as one ``CompletionOutput`` (what CUMULATIVE's last output holds)."""
        if self.last is None or not self.last.finished():
            raise RuntimeError(f"request {request_id!r}: vLLM's outputs ended before the sample finished")
        return dataclasses.replace(self.last, token_ids=self.token_ids, logprobs=self.logprobs, text="".join(self.text))


class AsyncVLLM:
    """An ``AsyncLLM`` built from ``engine_args`` (keyword arguments of ``AsyncEngineArgs``)."""

    def __init__(self, engine_args: dict[str, Any]) -> None:
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="skyrl-vllm-asyncio", daemon=True)
        self._thread.start()
        self._ids = itertools.count()
        self._lock = threading.Lock()
        # (vLLM request id, sample index) -> (skyrl request id, tokens received): unfinished samples
        self._progress: dict[tuple[str, int], tuple[str, int]] = {}
        self.engine: Any = None
        try:
            self.engine = self._run(self._build(dict(engine_args)))
        except BaseException:
            self._stop_loop()
            raise

    async def _build(self, engine_args: dict[str, Any]) -> Any:
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        engine_args.setdefault("disable_log_stats", True)  # as vllm.LLM: no periodic stats logging
        engine = AsyncLLM.from_engine_args(AsyncEngineArgs(**engine_args))
        if not hasattr(getattr(engine.engine_core, "outputs_queue", None), "empty"):
            engine.shutdown()
            raise RuntimeError(
                "this vLLM's AsyncLLM has no engine_core.outputs_queue, which skyrl's pause waits on "
                "(skyrl_vllm.async_driver); use the vLLM version skyrl pins"
            )
        return engine

    # -- generation -------------------------------------------------------------------------------

    def generate(self, prompts: Sequence[Any], params: Sequence[Any], request_ids: Sequence[str]) -> list[list[Any]]:
        """The finished ``CompletionOutput``s of each prompt, in sample-index order."""
        return self._run(self._all(prompts, params, request_ids))

    async def _all(self, prompts: Sequence[Any], params: Sequence[Any], request_ids: Sequence[str]) -> list[list[Any]]:
        # (run_coroutine_threadsafe takes a coroutine, not gather's future)
        return list(await asyncio.gather(*(self._one(p, sp, rid) for p, sp, rid in zip(prompts, params, request_ids))))

    async def _one(self, prompt: Any, params: Any, request_id: str) -> list[Any]:
        from vllm.sampling_params import RequestOutputKind

        # Each output carries only the tokens (logprobs, text) of its step, so nothing per step grows
        # with the sample (CUMULATIVE re-cuts the text so far each step; about as fast in vLLM 0.32,
        # benchmarks/vllm_output_kind.py). The samples are put back together here (``_Sample``), and
        # their lengths are the progress ``in_flight()`` reports.
        params.output_kind = RequestOutputKind.DELTA
        vllm_id = f"{request_id}#{next(self._ids)}"  # unique among requests in flight
        keys = [(vllm_id, index) for index in range(params.n)]
        samples: dict[int, _Sample] = {}
        with self._lock:
            self._progress.update({key: (request_id, 0) for key in keys})
        try:
            async for output in self.engine.generate(prompt, params, vllm_id):
                with self._lock:
                    for delta in output.outputs:
                        sample = samples.setdefault(delta.index, _Sample())
                        sample.add(delta)
                        if delta.finished():
                            self._progress.pop((vllm_id, delta.index), None)
                        else:
                            self._progress[(vllm_id, delta.index)] = (request_id, len(sample.token_ids))
        finally:
            with self._lock:
                for key in keys:
                    self._progress.pop(key, None)
        return [samples[index].completion(request_id) for index in sorted(samples)]

    def in_flight(self) -> dict[tuple[str, int], int]:
        """Tokens received so far by each unfinished sample (admitted or waiting), by (request id, sample index)."""
        with self._lock:
            return {(rid, key[1]): n for key, (rid, n) in self._progress.items()}

    # -- pause, weights, lifecycle ----------------------------------------------------------------

    def pause(self) -> None:
        self._run(self._pause())

    async def _pause(self) -> None:
        await self.engine.pause_generation(mode="keep", clear_cache=False)
        # What vLLM guarantees when that returns: in "keep" mode the engine core answers the pause
        # only once its own output queue is empty, and its outputs and that answer travel on one
        # socket, in order, so every output of the steps before the pause is in the client's
        # ``engine_core.outputs_queue``. Nothing public says when AsyncLLM's output handler has
        # passed them on to the requests' streams (vLLM's pause_generation itself only sleeps
        # 20 ms for that, "not required for correctness"), and in_flight() must be final here:
        # the engine contract compares it with the tokens stamped with the old version. So wait
        # until that (private) queue has stayed empty for a few loop turns; ``_build`` checks it
        # exists, so a vLLM that renames it fails at start, not here.
        queue = self.engine.engine_core.outputs_queue
        quiet = 0
        while quiet < _SETTLE_TURNS:
            await asyncio.sleep(0)
            quiet = quiet + 1 if queue.empty() else 0

    def resume(self) -> None:
        self._run(self.engine.resume_generation())

    def set_weight_version(self, label: str) -> None:
        """The label of the tokens of every step from now on (call while paused)."""
        self._run(self.engine.update_weight_version(label))

    def collective_rpc(self, method: str, args: tuple[Any, ...] = ()) -> list[Any]:
        return self._run(self.engine.collective_rpc(method, args=args))

    def reset_prefix_cache(self, reset_running_requests: bool = False) -> bool:
        """Empty the prefix cache; ``reset_running_requests``: first preempt every running request
        (its blocks freed, recomputed from its tokens when scheduled again)."""
        return bool(self._run(self.engine.reset_prefix_cache(reset_running_requests)))

    def sleep(self, level: int) -> None:
        self._run(self.engine.sleep(level))

    def wake_up(self) -> None:
        self._run(self.engine.wake_up())

    def shutdown(self) -> None:
        """Stop vLLM's processes and the loop; threads still waiting in ``generate`` get an error."""
        try:
            if self.engine is not None:
                self._run(self._shutdown())
        finally:
            self._stop_loop()

    async def _shutdown(self) -> None:
        engine, self.engine = self.engine, None
        engine.shutdown()
        for task in asyncio.all_tasks():
            if task is not asyncio.current_task():
                task.cancel()

    # -- helpers ----------------------------------------------------------------------------------

    def _run(self, coroutine: Any) -> Any:
        if not self._thread.is_alive():
            coroutine.close()
            raise RuntimeError("this vllm engine's event loop has stopped")
        return asyncio.run_coroutine_threadsafe(coroutine, self._loop).result()

    def _stop_loop(self) -> None:
        if self._thread.is_alive():
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=30)
        if not self._thread.is_alive() and not self._loop.is_closed():
            self._loop.close()
