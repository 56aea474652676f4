"""Where each RL step's rollouts come from, per ``trainer.mode`` (docs/training.md):

- ``sync``: generated at the start of the step by the policy the step trains (no staleness);
- ``one_step_off``: step k+1's rollouts are generated in a background thread while step k trains,
  so each trained batch comes from the policy one optimizer step before the trained one (staleness
  1, except step 1); weights sync after every step, once that generation has finished;
- ``fully_async``: worker threads keep up to ``trainer.fully_async.max_inflight`` trajectories in
  flight and put completed groups into a buffer; a step takes ``data.prompts_per_step`` groups from
  it; a group starts under policy v only while at most (v + max_staleness + 1) x prompts_per_step
  groups were started (less those dropped), so generation does not run so far ahead that its groups
  arrive stale. After each optimizer step the engine is paused at a token boundary, takes the new weights in
  place and resumes the same requests, so one trajectory may span several policy versions
  (``kv_on_update: recompute``, the default: the paused samples' keys/values are recomputed under the
  new weights, so each token is sampled by exactly the version it carries; ``keep``: they stay the
  old weights'). Groups whose oldest token is more than ``max_staleness`` versions behind the trained policy are dropped
  or regenerated (``on_stale``), and counted.

The RL loop (``skyrl_core.trainer.rl``) is the same for every mode: it asks its ``RolloutSource``
for a step's rollouts and hands it each new policy (``sync_weights``). Policy version ``v`` is the
policy after ``v`` training steps; the batch of step ``k`` trains policy ``k - 1``.
"""

from __future__ import annotations

import collections
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, Callable, Iterator

import torch

from skyrl_core.openmp_teams import release_thread_team
from skyrl_core.rollout import Trajectory, TrainingSample, request_seed, training_samples

if TYPE_CHECKING:
    from skyrl_core.config.schema import Config
    from skyrl_core.interfaces import InferenceEngine
    from skyrl_core.plugins.manager import SkyrlPluginManager
    from skyrl_core.rollout import RolloutGenerator, Sampling
    from skyrl_core.trainer.sampler import PromptSampler

# (step) -> (trajectories, training samples, metrics): one step's rollouts, as the sync loop collects them
CollectStep = Callable[[int], "tuple[list[Trajectory], list[TrainingSample], dict[str, float]]"]
ExportWeights = Callable[[], Iterator["tuple[str, torch.Tensor]"]]


def staleness_metrics(samples: list[TrainingSample], trained_version: int) -> dict[str, float]:
    """``async/staleness_*``: versions between each trained token's sampling policy and the trained
    policy (mean over trained tokens, max over samples); ``async/versions_per_sample_max``."""
    token_lags = [trained_version - v for s in samples for v in s.versions if v >= 0]
    per_sample = [len({v for v in s.versions if v >= 0}) for s in samples]
    return {
        "async/staleness_mean": sum(token_lags) / len(token_lags) if token_lags else 0.0,
        "async/staleness_max": float(max(token_lags, default=0)),
        "async/versions_per_sample_max": float(max(per_sample, default=0)),
    }


def load_policy(engine: InferenceEngine, generator: RolloutGenerator, weights: Iterator[tuple[str, torch.Tensor]],
                version: int) -> None:
    """Give the engine policy ``version``; its tokens from now on carry that version (stamped by the
    engine when it can take weights mid-generation, else by the rollout generator)."""
    if getattr(engine, "supports_pause", False):
        engine.update_weights(weights, version=version)
    else:
        engine.update_weights(weights)
    generator.policy_version = version


class SyncRollouts:
    """``trainer.mode: sync``: generate when asked, sync weights when told."""

    def __init__(self, collect_step: CollectStep, engine: InferenceEngine, generator: RolloutGenerator,
                 sampler: PromptSampler) -> None:
        self.collect_step, self.engine, self.generator, self.sampler = collect_step, engine, generator, sampler

    def collect(self, step: int) -> tuple[list[Trajectory], list[TrainingSample], dict[str, float]]:
        return self.collect_step(step)

    def sync_weights(self, step: int, export: ExportWeights) -> None:
        load_policy(self.engine, self.generator, export(), step)

    def sampler_state(self) -> dict[str, int]:
        """Where a resumed run starts drawing rows."""
        return self.sampler.state()

    def close(self) -> None:
        pass


class OneStepOffRollouts(SyncRollouts):
    """``trainer.mode: one_step_off``: step k+1's rollouts are generated while step k trains."""

    def __init__(self, collect_step: CollectStep, engine: InferenceEngine, generator: RolloutGenerator,
                 sampler: PromptSampler, *, last_step: int) -> None:
        super().__init__(collect_step, engine, generator, sampler)
        self.last_step = last_step
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="skyrl-rollouts")
        self._pending: tuple[int, Future, dict[str, int]] | None = None
        self._ready_at = 0.0  # when the background generation finished (the generator then waits)

    def _start(self, step: int) -> None:
        state = self.sampler.state()  # before the generation draws its rows: a resume redraws them

        def run() -> Any:
            try:
                return self.collect_step(step)
            finally:
                self._ready_at = time.perf_counter()

        self._pending = (step, self._pool.submit(run), state)
        # Rollouts compute on their thread while this one mostly waits on the trainer's processes.
        release_thread_team()

    def collect(self, step: int) -> tuple[list[Trajectory], list[TrainingSample], dict[str, float]]:
        if self._pending is None:
            self._start(step)
        pending_step, future, _state = self._pending
        assert pending_step == step, (pending_step, step)
        release_thread_team()  # this thread waits while the rollout thread computes (skyrl_core.openmp_teams)
        waited = time.perf_counter()
        trajectories, samples, metrics = future.result()
        trainer_wait = time.perf_counter() - waited
        self._pending = None
        generator_wait = max(0.0, time.perf_counter() - self._ready_at)
        if step < self.last_step:
            self._start(step + 1)  # overlaps this step's training
        return trajectories, samples, {
            **metrics, **staleness_metrics(samples, step - 1), "async/dropped": 0.0,
            "time/trainer_wait": trainer_wait, "time/generator_wait": generator_wait,
        }

    def sync_weights(self, step: int, export: ExportWeights) -> None:
        if self._pending is not None:  # the next batch stays of one policy: let it finish first
            self._pending[1].exception()
        super().sync_weights(step, export)

    def sampler_state(self) -> dict[str, int]:
        return self._pending[2] if self._pending is not None else self.sampler.state()

    def close(self) -> None:
        if self._pending is not None:
            self._pending[1].exception()  # (its error, if any, was the run's or is moot)
        self._pool.shutdown(wait=True)


class FullyAsyncRollouts(SyncRollouts):
    """``trainer.mode: fully_async``: a pool of generation workers and a buffer of completed groups."""

    def __init__(
        self, engine: InferenceEngine, generator: RolloutGenerator, sampler: PromptSampler, sampling: Sampling, *,
        seed: int, stepwise: bool,
        prompts_per_step: int, max_inflight: int, max_staleness: int, on_stale: str, kv_on_update: str = "recompute",
    ) -> None:
        super().__init__(lambda step: ([], [], {}), engine, generator, sampler)
        self.sampling, self.seed, self.stepwise = sampling, seed, stepwise
        self.prompts_per_step, self.max_staleness, self.on_stale = prompts_per_step, max_staleness, on_stale
        self.kv_on_update = kv_on_update
        self._lock = threading.Condition()
        self._buffer: collections.deque[tuple[dict[str, Any], list[Trajectory]]] = collections.deque()
        self._redo: collections.deque[dict[str, Any]] = collections.deque()  # stale rows to regenerate
        self._capacity = prompts_per_step * (max_staleness + 1)  # completed groups waiting, at most
        # Staleness-aware admission: a group may start under policy v only while the groups started
        # (less those dropped) number at most (v + max_staleness + 1) x prompts_per_step, so groups
        # are not generated so far ahead that they are stale when trained (they would be dropped,
        # wasted work); only a straggler overtaken by later groups can still exceed the bound.
        self._version = generator.policy_version
        self._admitted = self._version * prompts_per_step  # as if the steps before were generated here
        self._groups = 0
        self._dropped = 0
        self._generator_wait = 0.0
        self._error: BaseException | None = None
        self._stop = False
        workers = max(1, max_inflight // max(1, sampling.n))
        self._threads = [threading.Thread(target=self._work, name=f"skyrl-rollout-{i}", daemon=True) for i in range(workers)]
        for t in self._threads:
            t.start()

    # -- the generation workers ---------------------------------------------------------------

    def _work(self) -> None:
        try:
            while True:
                with self._lock:
                    waited = time.perf_counter()
                    while not self._stop and (len(self._buffer) >= self._capacity or self._admitted
                                              >= (self._version + self.max_staleness + 1) * self.prompts_per_step):
                        self._lock.wait()
                    self._generator_wait += time.perf_counter() - waited
                    if self._stop:
                        return
                    row = self._redo.popleft() if self._redo else self.sampler.next_rows(1)[0]
                    number = self._groups
                    self._groups += 1
                    self._admitted += 1
                trajectories = self.generator.generate(
                    [row], self.sampling, seed=request_seed(self.seed, "async", number), group_prefix=f"a{number}:"
                )
                with self._lock:
                    self._buffer.append((row, trajectories))
                    self._lock.notify_all()
        except BaseException as exc:  # the trainer raises it at its next collect
            with self._lock:
                self._error = exc
                self._lock.notify_all()

    # -- the trainer's side ---------------------------------------------------------------------

    def collect(self, step: int) -> tuple[list[Trajectory], list[TrainingSample], dict[str, float]]:
        trained = step - 1
        taken: list[list[Trajectory]] = []
        dropped = 0
        release_thread_team()  # this thread waits while the rollout threads compute (skyrl_core.openmp_teams)
        waited = time.perf_counter()
        with self._lock:
            while len(taken) < self.prompts_per_step:
                while not self._buffer and self._error is None:
                    self._lock.wait()
                if self._error is not None:
                    raise RuntimeError(f"fully_async rollout worker failed: {self._error}") from self._error
                row, trajectories = self._buffer.popleft()
                self._lock.notify_all()
                oldest = min((v for t in trajectories for v in t.versions), default=trained)
                if trained - oldest > self.max_staleness:
                    dropped += 1
                    self._admitted -= 1  # its place goes to a fresh group
                    if self.on_stale == "regenerate":
                        self._redo.append(row)
                    continue
                taken.append(trajectories)
            generator_wait, self._generator_wait = self._generator_wait, 0.0
        trainer_wait = time.perf_counter() - waited
        self._dropped += dropped
        trajectories = [t for group in taken for t in group]
        samples = training_samples(trajectories, stepwise=self.stepwise)
        return trajectories, samples, {
            **staleness_metrics(samples, trained), "async/dropped": float(dropped),
            "time/trainer_wait": trainer_wait, "time/generator_wait": generator_wait,
        }

    def sync_weights(self, step: int, export: ExportWeights) -> None:
        """Pause at a token boundary, load the new policy in place (recomputing the paused samples'
        keys/values under it, with ``kv_on_update: recompute``), resume the same requests."""
        self.engine.pause()
        try:
            load_policy(self.engine, self.generator, export(), step)
            if self.kv_on_update == "recompute":
                self.engine.recompute_kv()
        finally:
            self.engine.resume()
        release_thread_team()  # the load computed here; the rollout threads compute from now on
        with self._lock:  # a newer policy admits more groups
            self._version = step
            self._lock.notify_all()

    def sampler_state(self) -> dict[str, int]:
        # Rows of groups in flight or buffered are not replayed by a resumed run (it continues with
        # fresh rows); no completed step is lost.
        with self._lock:
            return self.sampler.state()

    def close(self) -> None:
        with self._lock:
            self._stop = True
            self._lock.notify_all()
        try:  # wakes workers parked in a pause
            self.engine.resume()
        except Exception:  # (an engine that cannot pause, or a dead engine process: nothing to resume)
            pass
        for t in self._threads:
            t.join()


def make_rollout_source(cfg: Config, *, collect_step: CollectStep, engine: InferenceEngine,
                        generator: RolloutGenerator, sampler: PromptSampler, sampling: Sampling) -> SyncRollouts:
    """The ``RolloutSource`` of ``cfg.trainer.mode`` (``close()`` it when the run ends)."""
    mode = cfg.trainer.mode
    if mode == "sync":
        return SyncRollouts(collect_step, engine, generator, sampler)
    if mode == "one_step_off":
        return OneStepOffRollouts(collect_step, engine, generator, sampler, last_step=cfg.trainer.steps)
    fa = cfg.trainer.fully_async
    return FullyAsyncRollouts(
        engine, generator, sampler, sampling, seed=cfg.trainer.seed, stepwise=cfg.rollout.stepwise,
        prompts_per_step=cfg.data.prompts_per_step, max_inflight=fa.max_inflight, max_staleness=fa.max_staleness,
        on_stale=fa.on_stale, kv_on_update=fa.kv_on_update,
    )


def check_mode(cfg: Config, plugin_manager: SkyrlPluginManager) -> None:
    """Refuse, before anything is built, a mode this run's parts cannot do as asked."""
    mode = cfg.trainer.mode
    if mode == "sync":
        return
    if cfg.algorithm.dynamic_sampling.mode != "none":
        raise ValueError(
            f"trainer.mode={mode!r} with algorithm.dynamic_sampling.mode={cfg.algorithm.dynamic_sampling.mode!r} is not "
            "built: dynamic sampling runs with trainer.mode=sync only"
        )
    # Both async modes call the engine from several threads at once (rollouts beside evaluation and
    # the handshake; fully_async also pauses it mid-generation): engines built for that say so.
    engine_class = plugin_manager.spec("inference_engine", cfg.engine.name).load_factory()
    if not getattr(engine_class, "supports_pause", False):
        raise ValueError(
            f"trainer.mode={mode!r} needs an engine that pauses in-flight requests and serves concurrent "
            f"generate calls; engine {cfg.engine.name!r} cannot (engines 'torch' and 'vllm' can); use trainer.mode=sync"
        )
    kv_on_update = cfg.trainer.fully_async.kv_on_update
    if mode == "fully_async" and kv_on_update == "recompute" and not getattr(engine_class, "supports_kv_recompute", False):
        raise ValueError(
            f"trainer.fully_async.kv_on_update={kv_on_update!r} needs an engine that recomputes the keys/values of "
            f"paused samples after a weight update; engine {cfg.engine.name!r} cannot (engines 'torch' and 'vllm' "
            "can); set trainer.fully_async.kv_on_update=keep"
        )
