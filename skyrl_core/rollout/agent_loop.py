"""The rollout generator: a batched multi-turn agent loop (single-turn is its one-turn case).

For each dataset row, ``n`` episodes each get their own environment instance. Turn 1 sends one
request per row with ``n`` samples (one shared prefill); each later turn sends one request per
still-running episode, all in one ``engine.generate`` call. Between turns the environment's
observation messages are rendered (only them, see ``skyrl_core.rollout.chat``) and appended as
tokens that are never trained. Nothing the model wrote is ever re-tokenised.
"""

from __future__ import annotations

import hashlib
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, Callable, Sequence

import attrs

from skyrl_core.rollout.chat import ChatCodec
from skyrl_core.rollout.trajectory import Segment, Trajectory
from skyrl_core.types import GeneratedSample, GenerationRequest, SamplingParams

if TYPE_CHECKING:
    from skyrl_core.plugins.manager import SkyrlPluginManager
    from skyrl_core.interfaces import InferenceEngine


class RolloutError(ValueError):
    """A row or an environment cannot be rolled out (prompt too long, bad observation, ...)."""


def request_seed(*parts: Any) -> int:
    """A 31-bit seed determined by ``parts`` alone (stable across processes and Python versions)."""
    digest = hashlib.sha256(":".join(map(str, parts)).encode()).digest()
    return int.from_bytes(digest[:4], "little") & 0x7FFFFFFF


@attrs.frozen(kw_only=True)
class Sampling:
    """How to sample each model turn of a rollout."""

    n: int = 1
    max_new_tokens: int = 64
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    stop: tuple[str, ...] = attrs.field(default=(), converter=tuple)


class EnvironmentFactory:
    """Builds a fresh environment per episode: ``row["env_class"]`` through the plugin manager.

    The config's default environment gets ``default_options``: its options object, already
    validated by the config loader (passed to the factory as keywords), or a plain dict
    (validated here).
    """

    def __init__(self, plugin_manager: SkyrlPluginManager, default_name: str, default_options: Any = None) -> None:
        self.pm = plugin_manager
        self.default_name = default_name
        self.default_options = default_options

    def __call__(self, env_class: str) -> Any:
        options = self.default_options if env_class == self.default_name else None
        if options is not None and attrs.has(type(options)):
            factory = self.pm.spec("environment", env_class).load_factory()
            return factory(**attrs.asdict(options, recurse=False))
        from skyrl_core.plugins.building import build_component

        return build_component(self.pm, "environment", env_class, dict(options or {}))


@attrs.define
class _Episode:
    row: dict[str, Any]
    env: Any
    trajectory: Trajectory
    context_ids: list[int]
    done: bool = False


class RolloutGenerator:
    """Runs episodes for dataset rows through an ``InferenceEngine`` and environments.

    ``max_response_tokens`` caps an episode's response (model and environment tokens over all
    turns); ``None`` leaves only ``max_turns`` and the per-turn ``max_new_tokens``. ``env_workers``
    > 1 runs that many episodes' environment steps of a turn at once, in threads (for environments
    whose steps wait on slow tools; each episode has its own environment instance).
    """

    def __init__(
        self,
        engine: InferenceEngine,
        codec: ChatCodec,
        make_env: Callable[[str], Any],
        *,
        max_turns: int = 1,
        max_prompt_tokens: int = 512,
        max_response_tokens: int | None = None,
        env_workers: int = 1,
    ) -> None:
        self.engine = engine
        self.env_workers = env_workers  # episodes whose environment step runs at once (threads)
        self.codec = codec
        self.make_env = make_env
        self.max_turns = max_turns
        self.max_prompt_tokens = max_prompt_tokens
        self.max_response_tokens = max_response_tokens
        # The policy version of the engine's weights, stamped on tokens the engine does not stamp
        # itself (the loop sets it at every weight sync).
        self.policy_version = 0

    def generate(
        self,
        rows: Sequence[dict[str, Any]],
        sampling: Sampling,
        *,
        seed: int,
        group_prefix: str = "",
        on_turn: Callable[[int, int], None] | None = None,
    ) -> list[Trajectory]:
        """``len(rows) * sampling.n`` trajectories, row by row (the ``n`` of a row are consecutive).

        Episode ``s`` of row ``g`` is ``trajectory_id = f"{group_prefix}{g}/{s}"`` with group
        ``f"{group_prefix}{g}"``. Every request is seeded from ``(seed, g, s, turn)``, so the same
        call gives the same trajectories whatever the engine batches together. ``on_turn(turn,
        finished_episodes)`` is called after each turn (progress bars).
        """
        n = sampling.n
        groups: list[list[_Episode]] = []
        for g, row in enumerate(rows):
            group_id = f"{group_prefix}{g}"
            episodes = []
            for s in range(n):
                env = self.make_env(row["env_class"])
                messages = list(env.reset(row))
                traj = Trajectory(group_id=group_id, trajectory_id=f"{group_id}/{s}", prompt_ids=[], messages=messages)
                episodes.append(_Episode(row=row, env=env, trajectory=traj, context_ids=[]))
            prompt_ids = self.codec.render_prompt(episodes[0].trajectory.messages)
            if len(prompt_ids) > self.max_prompt_tokens:
                raise RolloutError(
                    f"row {g}: the prompt has {len(prompt_ids)} tokens, more than rollout.max_prompt_tokens="
                    f"{self.max_prompt_tokens}; raise the limit or shorten the prompt"
                )
            for ep in episodes:
                ep.trajectory.prompt_ids = list(prompt_ids)
                ep.context_ids = list(prompt_ids)
            groups.append(episodes)

        finished = 0
        for turn in range(self.max_turns):
            requests: list[GenerationRequest] = []
            owners: list[list[_Episode]] = []
            for g, episodes in enumerate(groups):
                if turn == 0:  # the n episodes of a row share their prompt: one request, n samples
                    params = self._params(sampling, n=n, seed=request_seed(seed, g, turn), budget=self.max_response_tokens)
                    requests.append(GenerationRequest(request_id=f"{group_prefix}{g}", prompt_token_ids=episodes[0].context_ids, sampling=params))
                    owners.append(episodes)
                    continue
                for s, ep in enumerate(episodes):
                    if ep.done:
                        continue
                    budget = self._budget(ep)
                    params = self._params(sampling, n=1, seed=request_seed(seed, g, s, turn), budget=budget)
                    requests.append(GenerationRequest(request_id=f"{group_prefix}{g}/{s}", prompt_token_ids=ep.context_ids, sampling=params))
                    owners.append([ep])
            if not requests:
                break
            outputs = self.engine.generate(requests)
            if len(outputs) != len(requests):
                raise RolloutError(f"the engine answered {len(outputs)} of {len(requests)} requests")
            turns: list[tuple[_Episode, GeneratedSample]] = []
            for episodes, samples in zip(owners, outputs):
                if len(samples) != len(episodes):
                    raise RolloutError(f"the engine returned {len(samples)} samples for a request of n={len(episodes)}")
                turns.extend(zip(episodes, samples))
            last_turn = turn == self.max_turns - 1
            if self.env_workers > 1 and len(turns) > 1:  # slow environment steps (tool calls) overlap
                with ThreadPoolExecutor(max_workers=min(self.env_workers, len(turns))) as pool:
                    list(pool.map(lambda pair: self._advance(*pair, last_turn=last_turn), turns))
            else:
                for ep, sample in turns:
                    self._advance(ep, sample, last_turn=last_turn)
            finished += sum(ep.done for ep, _ in turns)
            if on_turn is not None:
                on_turn(turn, finished)
        return [ep.trajectory for episodes in groups for ep in episodes]

    # --- one turn of one episode ------------------------------------------------------------

    def _advance(self, ep: _Episode, sample: GeneratedSample, *, last_turn: bool) -> None:
        traj = ep.trajectory
        model_ids = list(sample.token_ids)
        versions = sample.token_versions or (self.policy_version,) * len(model_ids)
        traj.segments.append(Segment(token_ids=model_ids, logprobs=sample.logprobs, trained=True, versions=versions))
        ep.context_ids.extend(model_ids)
        traj.messages.append({"role": "assistant", "content": sample.text})
        traj.stop_reason = sample.stop_reason
        observation, reward, done, info = ep.env.step(sample.text)
        traj.step_rewards.append(float(reward))
        traj.info = dict(info or {})
        traj.correct = bool(traj.info["correct"]) if "correct" in traj.info else traj.reward >= 1.0
        if done or not observation:
            return self._finish(ep)
        if last_turn:
            traj.stop_reason = "max_turns"
            return self._finish(ep)
        if not isinstance(observation, list) or not all(isinstance(m, dict) and "content" in m for m in observation):
            raise RolloutError(f"environment {ep.row['env_class']!r} returned observation {observation!r:.120}; expected a list of messages")
        env_ids = self.codec.close_turn(model_ids) + self.codec.render_messages(observation)
        if self.max_response_tokens is not None and self._used(ep) + len(env_ids) >= self.max_response_tokens:
            traj.stop_reason = "max_response_tokens"
            return self._finish(ep)
        traj.segments.append(Segment(token_ids=env_ids, logprobs=[0.0] * len(env_ids), trained=False))
        traj.messages.extend(observation)
        ep.context_ids.extend(env_ids)

    def _finish(self, ep: _Episode) -> None:
        ep.done = True
        close = getattr(ep.env, "close", None)
        if callable(close):
            close()

    def _used(self, ep: _Episode) -> int:
        return len(ep.context_ids) - len(ep.trajectory.prompt_ids)

    def _budget(self, ep: _Episode) -> int | None:
        return None if self.max_response_tokens is None else self.max_response_tokens - self._used(ep)

    def _params(self, sampling: Sampling, *, n: int, seed: int, budget: int | None) -> SamplingParams:
        max_tokens = sampling.max_new_tokens if budget is None else max(1, min(sampling.max_new_tokens, budget))
        eos = self.codec.eos_token_id
        return SamplingParams(
            max_tokens=max_tokens, temperature=sampling.temperature, top_p=sampling.top_p, top_k=sampling.top_k,
            n=n, seed=seed, stop=sampling.stop, stop_token_ids=() if eos is None else (eos,),
        )
