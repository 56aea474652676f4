"""``TinkerService``: what the Tinker routes do, without HTTP.

Every request is checked completely (ownership, model, loss name and config, tensor lengths,
token ranges) before it is queued, so bad input gets a 4xx and queues nothing. Accepted work goes
onto one ordered queue served by one worker thread: requests run in the order they arrived, so
each training run's calls (which the SDK sends in ``seq_id`` order) run in order, and calls of
different adapters interleave without sharing state (each adapter has its own tensors and AdamW).
"""

from __future__ import annotations

import functools
import logging
import os
import queue
import re
import secrets
import shutil
import sys
import threading
import time
import traceback
import uuid
from typing import Any, Callable, Sequence

import attrs
import numpy as np

from skyrl_core.directories import publish_directory, recover_replaced
from skyrl_core.openmp_teams import release_thread_team
from skyrl_tinker.losses import LossInputError, check_loss
from skyrl_tinker.store import (
    DONE,
    FAILED,
    PENDING,
    CheckpointRow,
    FutureRow,
    InstanceRow,
    ModelRow,
    SamplingSessionRow,
    SessionRow,
    Store,
    done,
    failed,
    now,
)
from skyrl_tinker.wire import ForwardBackwardCall, encode_forward_backward_output, encode_sample_response

log = logging.getLogger("skyrl_tinker")

# A checkpoint name is one directory name: it starts with a letter, digit or '_' (so never '.' or
# '..', which would name the run's own directory or its parent: saving there replaced them whole).
NAME_PATTERN = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.\-]{0,127}")
MAX_LORA_RANK = 256
DEFAULT_LORA_ALPHA = 32.0


class TinkerError(Exception):
    """A refused request: HTTP ``status`` and a message naming the field and what is allowed."""

    status = 400

    def __init__(self, message: str, status: int | None = None) -> None:
        super().__init__(message)
        if status is not None:
            self.status = status


class NotFound(TinkerError):
    status = 404


Result = tuple[str, Any]  # ("json", dict) or ("proto", bytes)
# A work item may also return the rows its result makes (a checkpoint, a sampling session) as a
# third element: they are written in the transaction that finishes its future (one fsync; a crash
# leaves both or neither).
ResultWithRows = tuple[str, Any, list[Any]]
# Sampling requests queued back to back for the same weights share one engine call, up to this many.
MAX_SAMPLE_BATCH = 64
MAX_JOINING_CALLS = 4  # generate calls of one sampling batch in flight at once (each joins the engine's batch)
MAX_JOINED_SAMPLES = 4 * MAX_SAMPLE_BATCH  # requests one sampling batch takes before the queue's next work runs
# Before a sampling batch starts it waits for more requests while they keep coming: until no request
# has arrived for SAMPLE_GATHER_QUIET_S (counted from the last arrival, which may precede the wait:
# a burst that came while the adapter was being merged starts at once), at most SAMPLE_GATHER_MAX_S.
# The SDK sends a step's ``sample`` calls as one HTTP request each, within a few ms; started at the
# first, the engine took the others in as joins, each a prefill of its own and a merge into the batch.
# The wait also ends once as many requests have come as the last burst for the same model's weights
# had (requests less than SAMPLE_GATHER_QUIET_S apart, counted as they arrive, however they were
# batched): an RL loop sends the same burst every step, so its last request needs no quiet window
# after it (a larger burst's extra requests join the running batch, or wait for the next one).
SAMPLE_GATHER_QUIET_S = 0.01
SAMPLE_GATHER_MAX_S = 0.05


@attrs.frozen
class SampleJob:
    """A validated sampling request, queued like other work but run in batches (``_run_samples``)."""

    model_path: str | None  # the sampler checkpoint; None: the base model
    checkpoint_dir: str | None
    prompt: list[int]
    params: Any  # skyrl_core.types.SamplingParams
    prompt_logprobs: bool


@attrs.define
class SampleBurst:
    """One model's sampling requests as they arrive: a burst is requests less than
    ``SAMPLE_GATHER_QUIET_S`` apart."""

    last: float = float("-inf")  # perf_counter of the latest request
    count: int = 0  # requests in the current burst
    previous: int | None = None  # requests in the burst before it (None: none yet)

    def arrived(self, now: float) -> None:
        if now - self.last > SAMPLE_GATHER_QUIET_S:
            self.previous = self.count or None
            self.count = 0
        self.count += 1
        self.last = now

    def as_large_as_the_last(self) -> bool:
        """Exactly as large: one that grew past the last one's size is of unknown size again."""
        return self.count == self.previous


PARTIAL = ".partial"  # a checkpoint being written (skyrl_core.directories publishes it when whole)


class TinkerService:
    def __init__(
        self,
        model_dir: str,
        *,
        db_url: str,
        checkpoint_dir: str,
        engine: str = "torch",
        engine_options: dict[str, Any] | None = None,
        backend: str | None = None,
        base_model: str | None = None,
        lora_alpha: float = DEFAULT_LORA_ALPHA,
        cpu_gemm: str = "auto",
        dtype: str = "float32",
        tokenizer_id: str | None = None,
    ) -> None:
        from skyrl_tinker.trainer import LoraTrainer

        self.model_dir = model_dir
        self.base_model = base_model or os.path.basename(os.path.normpath(model_dir))
        # What the SDK's TrainingClient.get_tokenizer() loads (AutoTokenizer.from_pretrained): by
        # default the model directory itself when it holds a tokenizer, so a client on this machine
        # loads it offline; a hub id (--tokenizer-id) serves clients elsewhere.
        if tokenizer_id is None and os.path.isfile(os.path.join(model_dir, "tokenizer_config.json")):
            tokenizer_id = os.path.abspath(model_dir)
        self.tokenizer_id = tokenizer_id
        self.engine_name = engine
        self.engine_options = dict(engine_options or {})
        self._adapter_memory: dict[str, int] = {}  # model id -> bytes its adapter holds (or will)
        self._adapter_memory_lock = threading.Lock()
        self.lora_alpha = lora_alpha
        self.checkpoint_dir = os.path.abspath(checkpoint_dir)
        # Models made by another process have lost their adapters; futures it issued and never
        # finished are reported failed (their ids start with its instance id).
        self.instance = uuid.uuid4().hex[:16]
        self.store = Store(db_url)
        self.store.add(InstanceRow(id=self.instance))
        for row in self.store.rows(CheckpointRow):  # an overwrite cut short by a crash
            recover_replaced(row.directory)
        if backend is None:
            self.trainer = LoraTrainer(model_dir, cpu_gemm=cpu_gemm, dtype=dtype)
        else:
            from skyrl_tinker.backend_trainer import BackendLoraTrainer

            self.trainer = BackendLoraTrainer(model_dir, backend, cpu_gemm=cpu_gemm, dtype=dtype)
        self._sampler: Any = None
        self._sampler_tensors: tuple[str, Any] | None = None
        self._queue: queue.Queue = queue.Queue()
        self._arrived = threading.Condition()  # notified on every submission and every finished generate call
        self._last_arrival = 0.0  # perf_counter of the last submission (under self._arrived)
        self._bursts: dict[str | None, SampleBurst] = {}  # model id (None: the base model) -> its sampling requests' bursts (under self._arrived)
        # Future id -> callbacks to run (on the worker thread) once it is finished: the long-polls
        # waiting for it. A future is in here from submission until it is recorded.
        self._waiters: dict[str, list[Callable[[], None]]] = {}
        self._waiters_lock = threading.Lock()
        self._pending: dict[str, FutureRow] = {}  # queued or running; written when finished
        self._worker = threading.Thread(target=self._work, name="tinker-worker", daemon=True)
        self._worker.start()
        # The model was loaded on this thread; the worker and the sampling threads compute from
        # now on, and this thread's OpenMP team would slow theirs down (skyrl_core.openmp_teams).
        release_thread_team()

    # --- the work queue -----------------------------------------------------------------------------

    def submit(
        self, owner: str, kind: str, model_id: str | None, work: Callable[[], Result | ResultWithRows] | SampleJob, *,
        sampling_session: str | None = None, **extra: Any,
    ) -> dict[str, Any]:
        """Queue ``work``; the promise the SDK polls (``UntypedAPIFuture``) plus ``extra`` fields."""
        future_id = f"{self.instance}.{uuid.uuid4().hex}"
        self._pending[future_id] = FutureRow(id=future_id, owner=owner, model_id=model_id, kind=kind,
                                             sampling_session=sampling_session, status=PENDING, created=now())
        self._waiters[future_id] = []
        with self._arrived:  # (a sampling batch in progress may take it: _run_samples)
            self._queue.put((future_id, work))
            self._last_arrival = time.perf_counter()
            if isinstance(work, SampleJob):
                self._bursts.setdefault(_model_of(work.model_path), SampleBurst()).arrived(self._last_arrival)
            self._arrived.notify_all()
        return {"request_id": future_id, "model_id": model_id, **extra}

    def _work(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            if isinstance(item[1], SampleJob):
                self._run_samples(item)
            else:
                self._run(*item)

    def _next_samples(self, first: SampleJob, limit: int = MAX_SAMPLE_BATCH) -> list[tuple[str, SampleJob]]:
        """Up to ``limit`` sampling requests queued right after ``first`` for the same weights: they
        run in the same engine batch (nothing queued between them is skipped, so order is kept)."""
        taken: list[tuple[str, SampleJob]] = []
        with self._queue.mutex:
            waiting = self._queue.queue
            while (waiting and waiting[0] is not None and isinstance(waiting[0][1], SampleJob)
                   and waiting[0][1].model_path == first.model_path and len(taken) < limit):
                taken.append(waiting.popleft())
        return taken

    def _gather_samples(self, first: SampleJob, room: int) -> list[tuple[str, SampleJob]]:
        """Up to ``room`` more sampling requests for ``first``'s weights that arrive while they keep
        coming (``SAMPLE_GATHER_QUIET_S`` apart, for at most ``SAMPLE_GATHER_MAX_S``), so that a
        burst starts as one engine call; anything else queued, or a burst as large as the model's
        last one, ends the wait (order is kept)."""
        gathered: list[tuple[str, SampleJob]] = []
        deadline = time.perf_counter() + SAMPLE_GATHER_MAX_S
        with self._arrived:
            burst = self._bursts.get(_model_of(first.model_path)) or SampleBurst()
            while len(gathered) < room:
                more = self._next_samples(first, room - len(gathered))
                if more:
                    gathered += more
                elif self._queue.qsize():  # other work (or other weights) is next: do not hold it back
                    break
                if burst.as_large_as_the_last():
                    break
                remaining = min(self._last_arrival + SAMPLE_GATHER_QUIET_S, deadline) - time.perf_counter()
                if remaining <= 0:
                    break
                self._arrived.wait(remaining)
        return gathered

    def _run(self, future_id: str, work: Callable[[], Result | ResultWithRows]) -> None:
        # (A future is "running" only in memory: after a crash queued and running work are both
        # reported failed, so persisting the transition would cost an fsync for nothing.)
        start = time.perf_counter()
        try:
            form, payload, *rows = work()
        except Exception as error:  # noqa: BLE001 - reported to the client, the server keeps serving
            self._record([(future_id, self._failure(error))])
        else:
            self._record([(future_id, self._success(form, payload, time.perf_counter() - start))], rows[0] if rows else ())

    @staticmethod
    def _success(form: str, payload: Any, seconds: float) -> dict[str, Any]:
        return done(proto=payload, seconds=seconds) if form == "proto" else done(result=payload, seconds=seconds)

    @staticmethod
    def _failure(error: Exception) -> dict[str, Any]:
        if isinstance(error, TinkerError):
            return failed(str(error), "user")
        log.error("request failed:\n%s", "".join(traceback.format_exception(error)))
        return failed(f"{type(error).__name__}: {error}", "server")

    def _record(self, outcomes: list[tuple[str, dict[str, Any]]], rows: Sequence[Any] = ()) -> None:
        """Write outcomes and the ``rows`` they made durably (one transaction), then wake the
        long-polls waiting for them."""
        self.store.finish([(self._pending[future_id], values) for future_id, values in outcomes], rows)
        for future_id, _ in outcomes:
            del self._pending[future_id]  # (after the commit: a reader finds it here or there)
            with self._waiters_lock:
                wake = self._waiters.pop(future_id, [])
            for callback in wake:
                callback()

    def _run_samples(self, first: tuple[str, SampleJob]) -> None:
        """Sampling requests for the same weights as one engine batch. An engine that batches
        concurrent ``generate`` calls (``supports_pause``: skyrl-torch) also takes requests that
        arrive while it generates: each joins the running batch at the next token instead of
        waiting for it to end (the SDK sends a step's ``sample`` calls one HTTP request each)."""
        from skyrl_core.types import GenerationRequest

        start = time.perf_counter()
        job = first[1]
        jobs = [first, *self._next_samples(job)]
        try:
            tensors = self._sampler_weights(job.model_path, job.checkpoint_dir)
            sampler = self._get_sampler()
            sampler.load(job.model_path, tensors, self._base_for(sampler))
            sampler.ready()  # (after the load: a resting engine packs the new weights once)
        except Exception as error:  # noqa: BLE001
            self._record([(fid, self._failure(error)) for fid, _ in jobs])
            return
        jobs += self._gather_samples(job, MAX_SAMPLE_BATCH - len(jobs))
        results: dict[str, Any] = {}

        running = [0]  # generate calls not yet returned (under self._arrived)

        def generate(batch: list[tuple[str, SampleJob]]) -> None:
            requests = [GenerationRequest(request_id=fid, prompt_token_ids=tuple(j.prompt), sampling=j.params) for fid, j in batch]
            try:
                results.update(zip((fid for fid, _ in batch), sampler.sample(requests)))
            except Exception as error:  # noqa: BLE001
                results.update((fid, error) for fid, _ in batch)
            finally:
                with self._arrived:
                    running[0] -= 1
                    self._arrived.notify_all()

        if getattr(sampler.engine, "supports_pause", False):
            # This thread waits while the generate threads compute: its OpenMP team would slow
            # theirs down (skyrl_core.openmp_teams).
            release_thread_team()
            # Bounded on both sides: at most MAX_JOINING_CALLS generate calls at once (requests that
            # arrive meanwhile wait and join as one call), and at most MAX_JOINED_SAMPLES requests
            # in this batch, after which arrivals wait for the next one (a steady flood of samples
            # neither starts unbounded threads nor holds back the work queued behind it forever).
            batch = list(jobs)
            with self._arrived:  # (woken by a submission or a finished call: no polling)
                while True:
                    if batch:
                        running[0] += 1
                        threading.Thread(target=generate, args=(batch,), name="tinker-sample", daemon=True).start()
                    room = min(MAX_SAMPLE_BATCH, MAX_JOINED_SAMPLES - len(jobs)) if running[0] < MAX_JOINING_CALLS else 0
                    batch = self._next_samples(job, room)
                    jobs += batch
                    if not batch:
                        if not running[0]:
                            break
                        self._arrived.wait()
        else:
            generate(jobs)
        seconds = (time.perf_counter() - start) / len(jobs)
        outcomes = []
        for future_id, sample_job in jobs:
            sequences = results[future_id]
            try:
                if isinstance(sequences, Exception):
                    raise sequences
                prompt_logprobs = None
                if sample_job.prompt_logprobs:
                    scored = self.trainer.score(tensors, sample_job.prompt)
                    prompt_logprobs = np.concatenate([np.array([np.nan], dtype=np.float32), scored])
                outcomes.append((future_id, done(proto=encode_sample_response(sequences, prompt_logprobs), seconds=seconds)))
            except Exception as error:  # noqa: BLE001
                outcomes.append((future_id, self._failure(error)))
        self._record(outcomes)

    def when_finished(self, future_id: str, callback: Callable[[], None]) -> bool:
        """Run ``callback()`` (on the worker thread, so it must only hand over) once ``future_id``
        is finished; False, and no call, when it is not waiting to finish now (finished or unknown)."""
        with self._waiters_lock:
            waiting = self._waiters.get(future_id)
            if waiting is None:
                return False
            waiting.append(callback)
            return True

    def forget_waiter(self, future_id: str, callback: Callable[[], None]) -> None:
        with self._waiters_lock:
            waiting = self._waiters.get(future_id)
            if waiting is not None and callback in waiting:
                waiting.remove(callback)

    def retrieve(self, owner: str, future_id: str) -> Result:
        """The finished result (json or proto), an error record, or ``try_again``."""
        row = self._pending.get(future_id) or self.store.get(FutureRow, future_id)
        if row is None:
            instance = future_id.split(".", 1)[0]
            if instance != self.instance and self.store.is_recorded_instance(instance):
                return "json", {"error": "the server stopped before this request finished; it did not run to completion",
                                "category": "server"}
            raise NotFound(f"request_id {future_id!r} not found")
        if row.owner != owner:
            raise NotFound(f"request_id {future_id!r} not found")
        if row.status == DONE:
            if row.result_proto is not None:
                return "proto", row.result_proto
            import json

            return "json", json.loads(row.result_json)
        if row.status == FAILED:
            return "json", {"error": row.error, "category": row.category or "unknown"}
        return "json", {"type": "try_again", "request_id": future_id, "queue_state": "active"}

    def session_completions(self, owner: str, sampling_session_id: str, cursor: int) -> tuple[list[dict[str, Any]], int, bool]:
        """The sampling session's requests finished after ``cursor`` (their count so far: one
        worker runs requests in submission order, so finished ones are always a prefix), the new
        cursor, and whether any of its requests is still unfinished."""
        self.sampler_info(owner, sampling_session_id)
        finished = self.store.rows(FutureRow, owner=owner, sampling_session=sampling_session_id)
        pending = [r for r in list(self._pending.values()) if r.sampling_session == sampling_session_id and r.owner == owner]
        completions = [
            {"state": "finished", "request_id": r.id, "response_payload_uncompressed_size": len(r.result_proto or b"")}
            if r.status == DONE else {"state": "failed", "request_id": r.id}
            for r in finished[cursor:]
        ]
        return completions, len(finished), bool(pending)

    def close(self) -> None:
        self._queue.put(None)
        self._worker.join(timeout=60)
        if self._sampler is not None:
            self._sampler.close()
        self.trainer.close()

    # --- sessions -----------------------------------------------------------------------------------

    def create_session(self, owner: str, tags: list[str], user_metadata: Any, sdk_version: str) -> str:
        session_id = uuid.uuid4().hex[:16]
        self.store.add(SessionRow(id=session_id, owner=owner, tags=tags, user_metadata=user_metadata, sdk_version=sdk_version))
        return session_id

    def _session(self, owner: str, session_id: str) -> SessionRow:
        row = self.store.get(SessionRow, session_id)
        if row is None or row.owner != owner:
            raise NotFound(f"session_id {session_id!r} not found")
        return row

    def sessions(self, owner: str, limit: int, offset: int) -> dict[str, Any]:
        """The caller's sessions, oldest first (``GET /sessions``)."""
        rows = self.store.rows(SessionRow, owner=owner)
        return {"sessions": [r.id for r in rows[offset : offset + limit]]}

    def session(self, owner: str, session_id: str) -> dict[str, Any]:
        """A session's training runs and samplers (``GET /sessions/{id}``)."""
        row = self._session(owner, session_id)
        return {
            "training_run_ids": [m.id for m in self.store.rows(ModelRow, owner=owner, session_id=session_id)],
            "sampler_ids": [r.id for r in self.store.rows(SamplingSessionRow, owner=owner, session_id=session_id)],
            "user_metadata": row.user_metadata,
        }

    def heartbeat(self, owner: str, session_id: str) -> None:
        row = self._session(owner, session_id)
        self.store.update(SessionRow, session_id, last_heartbeat=now(), heartbeats=row.heartbeats + 1)

    # --- models -------------------------------------------------------------------------------------

    def _model(self, owner: str, model_id: str, *, live: bool = True) -> ModelRow:
        row = self.store.get(ModelRow, model_id)
        if row is None or row.owner != owner:
            raise NotFound(f"model_id {model_id!r} not found")
        if live and row.server_instance != self.instance:
            raise TinkerError(
                f"model_id {model_id!r} was created by an earlier server process and its adapter state is gone; "
                "create a training client from one of its checkpoints (create_training_client_from_state)",
                status=409,
            )
        return row

    def _check_base_model(self, base_model: str | None, field: str) -> None:
        if base_model is not None and base_model != self.base_model:
            raise TinkerError(f"{field}: {base_model!r} is not served here; this server serves {self.base_model!r}")

    def create_model(self, owner: str, request: Any) -> dict[str, Any]:
        self._session(owner, request.session_id)
        self._check_base_model(request.base_model, "base_model")
        optimizer = getattr(request.optimizer_config, "type", "adamw")
        if optimizer != "adamw":
            raise TinkerError(f"optimizer_config.type: {optimizer!r} is not supported; only 'adamw'")
        lora_config = request.lora_config
        if lora_config is None:
            raise TinkerError("lora_config: required; this server trains LoRA adapters only (full fine-tuning is not built)")
        if not 1 <= lora_config.rank <= MAX_LORA_RANK:
            raise TinkerError(f"lora_config.rank: must be in [1, {MAX_LORA_RANK}]; got {lora_config.rank}")
        groups = tuple(g for g, on in (("attn", lora_config.train_attn), ("mlp", lora_config.train_mlp), ("unembed", lora_config.train_unembed)) if on)
        if not groups:
            raise TinkerError("lora_config: train_attn, train_mlp and train_unembed are all false; nothing to train")
        try:
            self.trainer.check_groups(groups)
        except ValueError as error:
            raise TinkerError(f"lora_config: {error}") from None
        seed = lora_config.seed if lora_config.seed is not None else secrets.randbits(31)
        model_id = f"{request.session_id}:train:{request.model_seq_id}"
        spec = {"rank": lora_config.rank, "alpha": self.lora_alpha, "groups": list(groups), "seed": seed}
        self._new_model(owner, model_id, request.session_id, spec, request.user_metadata)

        def work() -> Result:
            self.trainer.create(model_id, rank=spec["rank"], alpha=spec["alpha"], groups=groups, seed=seed)
            return "json", {"model_id": model_id, "type": "create_model"}

        return self.submit(owner, "create_model", model_id, work)

    @functools.cached_property
    def engine_kv_budget(self) -> Any:
        """The sampler engine's KV budget (``sampler.kv_budget``; None: the engine has none), read at
        the first ``sample``: not at start-up, where it would import the engine's library (vLLM)
        before anything samples."""
        from skyrl_tinker.sampler import kv_budget

        return kv_budget(self.engine_name, self.model_dir, self.engine_options, dtype=self.trainer.dtype)

    def _reserve_adapter_memory(self, model_id: str, rank: int, groups: tuple[str, ...]) -> None:
        """Count a new training run's memory against the adapters' share of the machine, or refuse
        it (400) before anything is made: a client creating many high-rank runs would otherwise
        grow the server until the kernel kills it, with every other run's unsaved state."""
        need = self.trainer.adapter_bytes(rank, groups)
        with self._adapter_memory_lock:
            held = sum(self._adapter_memory.values())
            if held + need > self.trainer.adapter_memory_bytes:
                raise TinkerError(
                    f"lora_config.rank: a training run of rank {rank} on {', '.join(groups)} holds {need / 2**20:.0f} MiB "
                    f"(weights, gradients, AdamW moments); this server's {len(self._adapter_memory)} runs hold "
                    f"{held / 2**20:.0f} MiB of the {self.trainer.adapter_memory_bytes / 2**20:.0f} MiB they may use "
                    "(a quarter of its memory; runs live until the server restarts). Use a lower rank, or "
                    "restart the server and resume from checkpoints"
                )
            self._adapter_memory[model_id] = need

    def _new_model(self, owner: str, model_id: str, session_id: str, spec: dict[str, Any], user_metadata: Any) -> None:
        if self.store.get(ModelRow, model_id) is not None:
            raise TinkerError(f"model_seq_id: model {model_id!r} exists in this session", status=409)
        self._reserve_adapter_memory(model_id, int(spec["rank"]), tuple(spec["groups"]))
        self.store.add(
            ModelRow(
                id=model_id, owner=owner, session_id=session_id, base_model=self.base_model, lora_rank=spec["rank"],
                lora=spec, user_metadata=user_metadata, server_instance=self.instance,
            )
        )

    def get_info(self, owner: str, model_id: str) -> dict[str, Any]:
        row = self._model(owner, model_id, live=False)
        return {
            "type": "get_info",
            "model_id": model_id,
            "model_data": {"arch": type(self.trainer.model).__name__, "model_name": self.base_model, "tokenizer_id": self.tokenizer_id},
            "is_lora": True,
            "lora_rank": row.lora_rank,
            "model_name": self.base_model,
        }

    # --- training -----------------------------------------------------------------------------------

    def _examples(self, call: ForwardBackwardCall) -> list[Any]:
        from skyrl_tinker.trainer import Example

        try:
            rule = check_loss(call.loss_fn, call.loss_fn_config)
        except LossInputError as error:
            raise TinkerError(str(error)) from None
        if not call.data:
            raise TinkerError("forward_backward_input.data: empty; send at least one datum")
        allowed = set(rule.required) | set(rule.optional)
        examples = []
        for i, datum in enumerate(call.data):
            T = len(datum.tokens)
            where = f"forward_backward_input.data[{i}]"
            if T == 0:
                raise TinkerError(f"{where}.model_input: no tokens")
            if T > self.trainer.max_len:
                raise TinkerError(f"{where}.model_input: {T} tokens, more than the model's {self.trainer.max_len}")
            if T > self.trainer.max_train_tokens:  # (a big model's long context on a small machine)
                raise TinkerError(f"{where}.model_input: {T} tokens; a training pass of one datum may hold "
                                  f"{self.trainer.max_train_tokens} on this server's machine (half its memory)")
            _check_ids(datum.tokens, self.trainer.vocab_size, f"{where}.model_input")
            for name in rule.required:
                if name not in datum.inputs:
                    raise TinkerError(f"{where}.loss_fn_inputs.{name}: required by loss_fn {call.loss_fn!r}")
            for name, values in datum.inputs.items():
                if name not in allowed:
                    raise TinkerError(
                        f"{where}.loss_fn_inputs.{name}: not an input of loss_fn {call.loss_fn!r}; "
                        f"it takes {', '.join(sorted(allowed))}"
                    )
                if len(values) != T:
                    raise TinkerError(
                        f"{where}.loss_fn_inputs.{name}: length {len(values)}, but model_input has {T} tokens "
                        "(every loss input has one value per input position)"
                    )
                if name == "target_tokens":
                    _check_ids(values, self.trainer.vocab_size, f"{where}.loss_fn_inputs.target_tokens")
                elif not np.all(np.isfinite(values)):
                    raise TinkerError(f"{where}.loss_fn_inputs.{name}: holds non-finite values")
            inputs = {k: (v.astype(np.int64) if k == "target_tokens" else v.astype(np.float32)) for k, v in datum.inputs.items()}
            example = Example(datum.tokens, inputs)
            if self.trainer.next_token_targets_only and not np.array_equal(inputs["target_tokens"][:-1], datum.tokens[1:]):
                raise TinkerError(
                    f"{where}.loss_fn_inputs.target_tokens: with --backend every target must be the next input token "
                    "(target_tokens[i] == model_input[i + 1]), as in next-token data; the backend scores a prompt "
                    "and its continuation"
                )
            examples.append(example)
        return examples

    def forward_backward(self, owner: str, call: ForwardBackwardCall) -> dict[str, Any]:
        from skyrl_tinker.trainer import RELEASE_AFTER_BYTES

        self._model(owner, call.model_id)
        examples = self._examples(call)
        model_id, loss_fn, config = call.model_id, call.loss_fn, dict(call.loss_fn_config)
        # A pass this large is the server's memory peak: the engine gives back what it can meanwhile.
        large = self.trainer.bytes_per_token * sum(len(e.tokens) for e in examples) >= RELEASE_AFTER_BYTES

        def work() -> Result:
            if large and self._sampler is not None:
                self._sampler.rest()
            run = self.trainer.forward if call.forward_only else self.trainer.forward_backward
            logprobs, metrics = run(model_id, examples, loss_fn, config)
            return "proto", encode_forward_backward_output(logprobs, metrics)

        return self.submit(owner, "forward" if call.forward_only else "forward_backward", model_id, work)

    def optim_step(self, owner: str, request: Any) -> dict[str, Any]:
        from skyrl_tinker.trainer import AdamStep

        self._model(owner, request.model_id)
        params = request.optim_params
        if getattr(params, "type", None) not in (None, "adam", "adamw") and not hasattr(params, "beta2"):
            raise TinkerError(f"optim_params: {type(params).__name__} is not supported; only AdamParams")
        for field, value, ok, allowed in (
            ("learning_rate", params.learning_rate, params.learning_rate >= 0, ">= 0"),
            ("beta1", params.beta1, 0 <= params.beta1 < 1, "in [0, 1)"),
            ("beta2", params.beta2, 0 <= params.beta2 < 1, "in [0, 1)"),
            ("eps", params.eps, params.eps > 0, "> 0"),
            ("weight_decay", params.weight_decay, params.weight_decay >= 0, ">= 0"),
            ("grad_clip_norm", params.grad_clip_norm, params.grad_clip_norm >= 0, ">= 0 (0: no clipping)"),
        ):
            if not (ok and np.isfinite(value)):
                raise TinkerError(f"adam_params.{field}: must be {allowed}; got {value!r}")
        step = AdamStep(params.learning_rate, params.beta1, params.beta2, params.eps, params.weight_decay, params.grad_clip_norm)
        model_id = request.model_id

        def work() -> Result:
            metrics = self.trainer.optim_step(model_id, step)
            return "json", {"metrics": metrics}

        return self.submit(owner, "optim_step", model_id, work)

    # --- checkpoints --------------------------------------------------------------------------------

    def _checkpoint_name(self, name: str | None, field: str = "path") -> str:
        if name is None:
            return f"auto-{uuid.uuid4().hex[:12]}"
        if not isinstance(name, str) or not NAME_PATTERN.fullmatch(name):
            raise TinkerError(f"{field}: {name!r} is not a checkpoint name (letters, digits, '_', '.', '-', at most 128, "
                              "starting with a letter, digit or '_')")
        return name

    def _checkpoint_dir(self, owner: str, model_id: str, checkpoint_id: str) -> str:
        directory = os.path.normpath(os.path.join(self.checkpoint_dir, owner, model_id.replace(":", "_"), checkpoint_id))
        if os.path.commonpath([directory, self.checkpoint_dir]) != self.checkpoint_dir or directory == self.checkpoint_dir:
            raise TinkerError(f"path: {checkpoint_id!r} does not name a checkpoint inside this server's checkpoint directory")
        return directory

    def _reserve_checkpoint(self, owner: str, model_id: str, kind: str, name: str, overwrite: bool) -> tuple[str, str, str]:
        segment = "weights" if kind == "training" else "sampler_weights"
        checkpoint_id = f"{segment}/{name}"
        path = f"tinker://{model_id}/{checkpoint_id}"
        if self.store.get(CheckpointRow, path) is not None and not overwrite:
            raise TinkerError(f"path: checkpoint {path!r} exists (pass overwrite=True to replace it)", status=409)
        return path, checkpoint_id, self._checkpoint_dir(owner, model_id, checkpoint_id)

    def _checkpoint_row(self, owner: str, model_id: str, kind: str, path: str, checkpoint_id: str, directory: str, user_metadata: Any) -> CheckpointRow:
        size = sum(os.path.getsize(os.path.join(directory, f)) for f in os.listdir(directory))
        return CheckpointRow(tinker_path=path, owner=owner, model_id=model_id, kind=kind, checkpoint_id=checkpoint_id,
                             directory=directory, size_bytes=size, user_metadata=user_metadata, created=now())

    def save_weights(self, owner: str, request: Any) -> dict[str, Any]:
        self._model(owner, request.model_id)
        name = self._checkpoint_name(request.path)
        path, checkpoint_id, directory = self._reserve_checkpoint(owner, request.model_id, "training", name, request.overwrite)
        model_id = request.model_id

        def work() -> ResultWithRows:
            tmp = directory + PARTIAL
            shutil.rmtree(tmp, ignore_errors=True)
            self.trainer.save(model_id, tmp, optimizer=True)
            publish_directory(tmp, directory)
            checkpoint = self._checkpoint_row(owner, model_id, "training", path, checkpoint_id, directory, request.user_metadata)
            return "json", {"path": path, "type": "save_weights"}, [checkpoint]

        return self.submit(owner, "save_weights", model_id, work)

    def save_weights_for_sampler(self, owner: str, request: Any) -> dict[str, Any]:
        row = self._model(owner, request.model_id)
        if request.kind != "snapshot":
            raise TinkerError(f"kind: {request.kind!r} is not supported; only 'snapshot' (the weights as of this call)")
        name = self._checkpoint_name(request.path)
        path, checkpoint_id, directory = self._reserve_checkpoint(owner, request.model_id, "sampler", name, False)
        model_id, named = request.model_id, request.path is not None

        def work() -> ResultWithRows:
            tmp = directory + PARTIAL
            shutil.rmtree(tmp, ignore_errors=True)
            written = self.trainer.save(model_id, tmp, optimizer=False)
            publish_directory(tmp, directory)
            # The next sampling request for these weights (an RL loop's next step) takes them from
            # memory, not from the file just written.
            self._sampler_tensors = (path, written)
            self._preload_sampler(model_id, path, written)
            checkpoint = self._checkpoint_row(owner, model_id, "sampler", path, checkpoint_id, directory, request.user_metadata)
            if named:
                return "json", {"path": path, "type": "save_weights_for_sampler"}, [checkpoint]
            sampling_session_id = uuid.uuid4().hex[:16]
            session = SamplingSessionRow(id=sampling_session_id, owner=owner, session_id=row.session_id,
                                         base_model=self.base_model, model_path=path)
            return "json", {"path": None, "sampling_session_id": sampling_session_id, "type": "save_weights_for_sampler"}, [checkpoint, session]

        return self.submit(owner, "save_weights_for_sampler", model_id, work)

    def _checkpoint(self, owner: str, path: str, field: str = "path") -> CheckpointRow:
        if not path.startswith("tinker://"):
            raise TinkerError(f"{field}: {path!r} is not a tinker:// path (tinker://<training run>/weights/<name>)")
        row = self.store.get(CheckpointRow, path)
        if row is None or row.owner != owner:
            raise NotFound(f"{field}: checkpoint {path!r} not found")
        return row

    def load_weights(self, owner: str, request: Any) -> dict[str, Any]:
        from skyrl_tinker.trainer import read_meta

        checkpoint = self._checkpoint(owner, request.path)
        if checkpoint.kind != "training":
            raise TinkerError(f"path: {request.path!r} is a sampler checkpoint; load_weights needs one saved by save_state")
        meta = read_meta(checkpoint.directory)
        if request.session_id is not None:  # create-via-load: the load makes the model
            self._session(owner, request.session_id)
            self._check_base_model(request.base_model, "base_model")
            if request.model_seq_id is None:
                raise TinkerError("model_seq_id: required with session_id")
            model_id = f"{request.session_id}:train:{request.model_seq_id}"
            spec = {k: meta[k] for k in ("rank", "alpha", "groups", "seed")}
            self._new_model(owner, model_id, request.session_id, spec, request.user_metadata)
            create = True
        elif request.model_id is not None:
            row = self._model(owner, request.model_id)
            model_id, create = request.model_id, False
            if (row.lora["rank"], list(row.lora["groups"])) != (meta["rank"], list(meta["groups"])):
                raise TinkerError(
                    f"path: {request.path!r} holds a rank-{meta['rank']} adapter on {meta['groups']}; model {model_id!r} "
                    f"is rank {row.lora['rank']} on {row.lora['groups']}"
                )
        else:
            raise TinkerError("load_weights needs model_id, or session_id with model_seq_id")
        with_optimizer, directory = bool(request.optimizer), checkpoint.directory

        def work() -> Result:
            if create:
                self.trainer.create(model_id, rank=meta["rank"], alpha=meta["alpha"], groups=tuple(meta["groups"]), seed=meta["seed"])
            self.trainer.load(model_id, directory, optimizer=with_optimizer)
            return "json", {"path": request.path, "model_id": model_id, "type": "load_weights"}

        return self.submit(owner, "load_weights", model_id, work)

    def weights_info(self, owner: str, path: str) -> dict[str, Any]:
        from skyrl_tinker.trainer import read_meta

        meta = read_meta(self._checkpoint(owner, path, "tinker_path").directory)
        groups = set(meta["groups"])
        return {"base_model": self.base_model, "is_lora": True, "lora_rank": meta["rank"],
                "train_attn": "attn" in groups, "train_mlp": "mlp" in groups, "train_unembed": "unembed" in groups}

    def delete_checkpoint(self, owner: str, model_id: str, checkpoint_id: str) -> None:
        row = self._checkpoint(owner, f"tinker://{model_id}/{checkpoint_id}")
        self.store.delete(CheckpointRow, row.tinker_path)
        shutil.rmtree(row.directory, ignore_errors=True)

    # --- listing ------------------------------------------------------------------------------------

    @staticmethod
    def checkpoint_record(row: CheckpointRow) -> dict[str, Any]:
        return {"checkpoint_id": row.checkpoint_id, "checkpoint_type": row.kind, "time": row.created.isoformat(),
                "tinker_path": row.tinker_path, "size_bytes": row.size_bytes, "public": False, "user_metadata": row.user_metadata}

    def checkpoints(self, owner: str, model_id: str | None = None) -> list[dict[str, Any]]:
        if model_id is not None:
            self._model(owner, model_id, live=False)
            rows = self.store.rows(CheckpointRow, owner=owner, model_id=model_id)
        else:
            rows = self.store.rows(CheckpointRow, owner=owner)
        return [self.checkpoint_record(r) for r in rows]

    def training_run(self, owner: str, model_id: str) -> dict[str, Any]:
        row = self._model(owner, model_id, live=False)
        rows = self.store.rows(CheckpointRow, owner=owner, model_id=model_id)
        last = {kind: next((self.checkpoint_record(r) for r in reversed(rows) if r.kind == kind), None) for kind in ("training", "sampler")}
        return {"training_run_id": row.id, "base_model": row.base_model, "model_owner": owner, "is_lora": True,
                "corrupted": False, "lora_rank": row.lora_rank, "last_request_time": row.last_request.isoformat(),
                "last_checkpoint": last["training"], "last_sampler_checkpoint": last["sampler"],
                "user_metadata": row.user_metadata}

    def training_runs(self, owner: str, limit: int, offset: int) -> dict[str, Any]:
        rows = self.store.rows(ModelRow, owner=owner)
        page = rows[offset : offset + limit]
        return {"training_runs": [self.training_run(owner, r.id) for r in page],
                "cursor": {"offset": offset, "limit": limit, "total_count": len(rows)}}

    # --- sampling -----------------------------------------------------------------------------------

    def create_sampling_session(self, owner: str, request: Any) -> str:
        self._session(owner, request.session_id)
        if request.model_path is not None:
            self._checkpoint(owner, request.model_path, "model_path")
        elif request.base_model is None:
            raise TinkerError("base_model or model_path: one is required")
        self._check_base_model(request.base_model, "base_model")
        sampling_session_id = uuid.uuid4().hex[:16]
        self.store.add(SamplingSessionRow(id=sampling_session_id, owner=owner, session_id=request.session_id,
                                          base_model=self.base_model, model_path=request.model_path))
        return sampling_session_id

    def sampler_info(self, owner: str, sampler_id: str) -> dict[str, Any]:
        row = self.store.get(SamplingSessionRow, sampler_id)
        if row is None or row.owner != owner:
            raise NotFound(f"sampler {sampler_id!r} not found")
        return {"sampler_id": sampler_id, "base_model": row.base_model, "model_path": row.model_path}

    def asample(self, owner: str, request: Any) -> dict[str, Any]:
        from skyrl_core.engines.requests import check_request
        from skyrl_core.types import GenerationRequest, SamplingParams

        if request.sampling_session_id is not None:
            model_path = self.sampler_info(owner, request.sampling_session_id)["model_path"]
        else:
            self._check_base_model(request.base_model, "base_model")
            model_path = request.model_path
            if model_path is None and request.base_model is None:
                raise TinkerError("sampling_session_id, model_path or base_model: one is required")
        checkpoint_dir = self._checkpoint(owner, model_path, "model_path").directory if model_path else None
        prompt = [t for chunk in request.prompt.chunks for t in _chunk_tokens(chunk)]
        if not prompt:
            raise TinkerError("prompt: no tokens")
        _check_ids(np.asarray(prompt), self.trainer.vocab_size, "prompt")
        p = request.sampling_params
        max_tokens = p.max_tokens if p.max_tokens is not None else 64
        # the sampler's own length limit (--engine-option max_model_len) when shorter than the model's:
        # checked here, since in the engine it would fail every request batched with this one
        positions = min(self.trainer.max_len, int(self.engine_options.get("max_model_len") or self.trainer.max_len))
        if max_tokens < 1 or len(prompt) + max_tokens > positions:
            raise TinkerError(f"sampling_params.max_tokens: {max_tokens} with a {len(prompt)}-token prompt does not fit the sampler's {positions} positions")
        # likewise one sample beyond the engine's KV-cache budget (--engine-option kv_cache_memory_bytes)
        too_long = self.engine_kv_budget.refusal(len(prompt) + max_tokens) if self.engine_kv_budget is not None else None
        if too_long is not None:
            raise TinkerError(f"sampling_params.max_tokens: {max_tokens} with a {len(prompt)}-token prompt: {too_long}")
        if not 1 <= request.num_samples <= 1024:
            raise TinkerError(f"num_samples: must be in [1, 1024]; got {request.num_samples}")
        for field in ("topk_prompt_logprobs", "topk_sample_logprobs", "prompt_alt_tokens_k"):
            if getattr(request, field, 0):
                raise TinkerError(f"{field}: not supported by this server (0 only)")
        if request.target_prompt_logprobs is not None or request.record_stability_info:
            raise TinkerError("target_prompt_logprobs / record_stability_info: not supported by this server")
        stop = p.stop
        stop_strings: tuple[str, ...] = ()
        stop_ids: tuple[int, ...] = ()
        if isinstance(stop, str):
            stop_strings = (stop,)
        elif stop is not None and len(stop) == 0:
            raise TinkerError("sampling_params.stop: [] (never stop at EOS) is not supported; give None or stop tokens/strings")
        elif stop is not None and all(isinstance(s, str) for s in stop):
            stop_strings = tuple(stop)
        elif stop is not None:
            stop_ids = tuple(int(s) for s in stop)
        params = SamplingParams(max_tokens=max_tokens, temperature=p.temperature, top_p=p.top_p,
                                top_k=max(0, p.top_k), n=request.num_samples, seed=p.seed,
                                stop=stop_strings, stop_token_ids=stop_ids)
        try:  # what no engine can sample (a NaN temperature, a seed no generator takes), refused here:
            # in the engine it would fail every request batched with this one
            check_request(GenerationRequest(request_id="sample", prompt_token_ids=tuple(prompt), sampling=params),
                          sampling_field="sampling_params")
        except ValueError as error:
            raise TinkerError(str(error)) from None

        job = SampleJob(model_path, checkpoint_dir, prompt, params, bool(request.prompt_logprobs))
        # Sequence identity is fixed at submission: one id per requested sample, in response order.
        sequence_ids = [f"{uuid.uuid4().hex[:12]}:{i}" for i in range(request.num_samples)]
        return self.submit(owner, "sample", None, job, sampling_session=request.sampling_session_id,
                           sample_sequence_ids=sequence_ids)

    def _sampler_weights(self, model_path: str | None, directory: str | None) -> Any:
        from skyrl_tinker.trainer import read_adapter

        if model_path is None:
            return None
        if self._sampler_tensors is None or self._sampler_tensors[0] != model_path:
            self._sampler_tensors = (model_path, read_adapter(directory))
        return self._sampler_tensors[1]

    def _preload_sampler(self, model_id: str, path: str, tensors: dict[str, Any]) -> None:
        """Merge a sampler checkpoint into the engine as it is saved, when the engine holds an
        earlier sampler checkpoint of the same model: an RL loop samples these weights next. The
        merge then runs while the client waits for the save, not while its sampling requests
        arrive, whose parsing holds the GIL between every small op of the merge (measured on the
        tiny model: 3 ms alone, 20-50 ms beside a burst of requests). Another model's weights are
        left in place (two adapters' loops would swap them twice a step), and a failure here is
        left to the sampling request that needs these weights to report."""
        sampler = self._sampler
        if sampler is None or sampler.loaded is None or _model_of(sampler.loaded) != model_id:
            return
        try:
            sampler.load(path, tensors, self._base_for(sampler))
        except Exception as error:  # noqa: BLE001 - the sampling request retries the load and reports it
            log.warning("merging %s into the sampler failed (its first sampling request retries): %s", path, error)

    def _base_for(self, sampler: Any) -> dict[str, Any]:
        """The base weights a load merges into: every weight for an engine that takes full sets,
        the adapted modules' otherwise."""
        return self.trainer.hf_weights() if sampler.full_sets else self.trainer.base_weights()

    def _get_sampler(self) -> Any:
        if self._sampler is None:
            from skyrl_tinker.sampler import Sampler, build_engine

            model_dir = self.model_dir
            if self.engine_name != "torch" and self.trainer.unties_unembedding:
                # An adapter on a tied unembedding merges into lm_head alone. skyrl-torch unties a
                # loaded model on that update; vLLM loads no lm_head of a tied model, so it starts
                # from an untied copy (the same logits; one embedding-sized tensor more).
                from skyrl_core.engines.model_dir import untied_model_dir

                model_dir = untied_model_dir(model_dir, os.path.join(self.checkpoint_dir, ".engine-model"))
            engine = build_engine(self.engine_name, model_dir, self.engine_options, dtype=self.trainer.dtype)
            self._sampler = Sampler(engine, full_sets=self.engine_name != "torch", rests=self.engine_name == "torch")
            print(f"skyrl tinker: sampling engine {self.engine_name!r} started ({type(engine).__module__}, {self.trainer.dtype})", file=sys.stderr, flush=True)
        return self._sampler


def _model_of(path: str | None) -> str | None:
    """The training model a ``tinker://<model id>/...`` checkpoint path belongs to (None: None)."""
    return None if path is None else path[len("tinker://"):].split("/", 1)[0]


def _chunk_tokens(chunk: Any) -> list[int]:
    tokens = getattr(chunk, "tokens", None)
    if tokens is None:
        raise TinkerError(f"prompt: {type(chunk).__name__} chunks are not supported (text tokens only)")
    return list(tokens)


def _check_ids(ids: np.ndarray, vocab_size: int, field: str) -> None:
    if len(ids) and (int(ids.min()) < 0 or int(ids.max()) >= vocab_size):
        bad = int(ids.max()) if int(ids.max()) >= vocab_size else int(ids.min())
        raise TinkerError(f"{field}: token id {bad} is outside the vocabulary [0, {vocab_size})")
