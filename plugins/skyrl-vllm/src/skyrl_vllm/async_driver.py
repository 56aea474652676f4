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
"""

from __future__ import annotations

import asyncio
import itertools
import threading
from typing import Any, Sequence

# Event-loop turns without engine output after which every output from before a pause has
# reached the per-request consumers below (the output handler takes one turn per batch of outputs,
# a consumer one more).
_SETTLE_TURNS = 8


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
        return AsyncLLM.from_engine_args(AsyncEngineArgs(**engine_args))

    # -- generation -------------------------------------------------------------------------------

    def generate(self, prompts: Sequence[Any], params: Sequence[Any], request_ids: Sequence[str]) -> list[list[Any]]:
        """The finished ``CompletionOutput``s of each prompt, in sample-index order."""
        return self._run(self._all(prompts, params, request_ids))

    async def _all(self, prompts: Sequence[Any], params: Sequence[Any], request_ids: Sequence[str]) -> list[list[Any]]:
        # (run_coroutine_threadsafe takes a coroutine, not gather's future)
        return list(await asyncio.gather(*(self._one(p, sp, rid) for p, sp, rid in zip(prompts, params, request_ids))))

    async def _one(self, prompt: Any, params: Any, request_id: str) -> list[Any]:
        from vllm.sampling_params import RequestOutputKind

        params.output_kind = RequestOutputKind.CUMULATIVE  # every step's progress, for in_flight()
        vllm_id = f"{request_id}#{next(self._ids)}"  # unique among requests in flight
        keys = [(vllm_id, index) for index in range(params.n)]
        latest: dict[int, Any] = {}
        with self._lock:
            self._progress.update({key: (request_id, 0) for key in keys})
        try:
            async for output in self.engine.generate(prompt, params, vllm_id):
                with self._lock:
                    for completion in output.outputs:
                        latest[completion.index] = completion
                        if completion.finished():
                            self._progress.pop((vllm_id, completion.index), None)
                        else:
                            self._progress[(vllm_id, completion.index)] = (request_id, len(completion.token_ids))
        finally:
            with self._lock:
                for key in keys:
                    self._progress.pop(key, None)
        return [latest[index] for index in sorted(latest)]

    def in_flight(self) -> dict[tuple[str, int], int]:
        """Tokens received so far by each unfinished sample (admitted or waiting), by (request id, sample index)."""
        with self._lock:
            return {(rid, key[1]): n for key, (rid, n) in self._progress.items()}

    # -- pause, weights, lifecycle ----------------------------------------------------------------

    def pause(self) -> None:
        self._run(self._pause())

    async def _pause(self) -> None:
        await self.engine.pause_generation(mode="keep", clear_cache=False)
        # The engine core sent every output of the steps before the pause ahead of the pause's own
        # reply; let the output handler and the consumers take them, so in_flight() is final.
        quiet = 0
        while quiet < _SETTLE_TURNS:
            await asyncio.sleep(0)
            quiet = quiet + 1 if self.engine.engine_core.outputs_queue.empty() else 0

    def resume(self) -> None:
        self._run(self.engine.resume_generation())

    def set_weight_version(self, label: str) -> None:
        """The label of the tokens of every step from now on (call while paused)."""
        self._run(self.engine.update_weight_version(label))

    def collective_rpc(self, method: str, args: tuple[Any, ...] = ()) -> list[Any]:
        return self._run(self.engine.collective_rpc(method, args=args))

    def reset_prefix_cache(self) -> bool:
        return bool(self._run(self.engine.reset_prefix_cache()))

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
