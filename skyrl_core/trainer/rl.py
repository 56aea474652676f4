"""The RL training loop (synchronous), in the order it runs:

    data -> rollouts -> rewards -> advantages -> (reference / KL) -> old logprobs
         -> PPO epochs over mini-batches -> optimizer steps -> contract handshake -> weight sync
         -> eval every k steps -> checkpoint

``train(cfg)`` is what ``skyrl train CONFIG`` runs. Outputs go to ``cfg.trainer.output_dir``:
``config.yaml`` (the resolved config), ``metrics.jsonl`` (one record per step, see
``skyrl_core.trainer.metrics``), ``metrics.png`` and ``checkpoints/``. A run resumed from a
checkpoint (``trainer.resume``) continues exactly: same rows, same sampling seeds, same weights,
optimizer and RNG, so its metrics equal those of an uninterrupted run.
"""

from __future__ import annotations

import contextlib
import math
import os
import random
import time
from typing import TYPE_CHECKING, Any

import attrs
import torch
import yaml

from skyrl_core.algorithms.distillation import distillation_advantages, teacher_problems
from skyrl_core.algorithms.kl import AdaptiveKLController, FixedKLController, apply_kl_penalty, kl_estimate
from skyrl_core.algorithms.advantages import zero_variance_group_mask
from skyrl_core.algorithms.off_policy import off_policy_correction
from skyrl_core.algorithms.precedence import effective_loss_reduction
from skyrl_core.algorithms.reductions import reduction_weights
from skyrl_core.compute_share import set_trainer_computing
from skyrl_core.config.errors import ConfigError, ConfigIssue
from skyrl_core.config.loader import unstructure
from skyrl_core.config.schema import Config, OffPolicyConfig
from skyrl_core.heap import keep_freed_memory, release_freed_memory, set_mmap_threshold
from skyrl_core.models import load_tokenizer
from skyrl_core.plugins.manager import get_plugin_manager
from skyrl_core.rollout import (
    ChatCodec,
    EnvironmentFactory,
    RolloutGenerator,
    Sampling,
    Trajectory,
    TrainingSample,
    build_training_batch,
    request_seed,
    token_rewards,
    training_samples,
)
from skyrl_core.trainer import checkpoint as ckpt
from skyrl_core.trainer.critic import Critic, check_critic_choice
from skyrl_core.trainer.evaluate import evaluate
from skyrl_core.trainer.failure import RunActivity
from skyrl_core.trainer.memory_estimate import check_step_memory
from skyrl_core.trainer.loss import RLLoss
from skyrl_core.trainer.metrics import METRICS_FILE, PLOT_FILE, MetricsLog, plot_metrics
from skyrl_core.trainer.async_rl import check_mode, load_policy, make_rollout_source
from skyrl_core.trainer.divergence import NonFiniteTrainingError, check_finite, check_weights_finite
from skyrl_core.trainer.preflight import check_run_inputs, prepare_output_dir
from skyrl_core.trainer.progress import Progress
from skyrl_core.trainer.reference import ReferencePolicy
from skyrl_core.trainer.runtime import (build_backend, build_engine, build_selected, check_engine_placement, handshake,
                                       resolve_model)
from skyrl_core.ray_placement import start_placement
from skyrl_core.trainer.sampler import PromptSampler
from skyrl_core.types import TrainingBatch

if TYPE_CHECKING:
    from skyrl_core.interfaces import AdvantageEstimator
    from skyrl_core.plugins.manager import SkyrlPluginManager


@attrs.frozen
class RunResult:
    run_dir: str
    history: list[dict[str, Any]]
    eval_before: dict[str, float]
    eval_after: dict[str, float]


def train(cfg: Config, *, plugin_manager: SkyrlPluginManager | None = None) -> RunResult:
    """Run RL training as ``cfg`` says; return the metrics history."""
    pm = plugin_manager or get_plugin_manager()
    tc = cfg.trainer
    # bad paths, an occupied output_dir, components that cannot run here: all fail here, before anything is written
    inputs = check_run_inputs(cfg, plugin_manager=pm)
    distill = cfg.algorithm.distillation
    if teacher_problems(cfg):
        raise ConfigError([ConfigIssue("algorithm.distillation.teacher", p) for p in teacher_problems(cfg)])
    check_mode(cfg, pm)  # a mode this run's parts cannot do as asked
    check_engine_placement(cfg, pm)  # engine keys that would not do what they say
    if tc.memory_check:  # a step the kernel would kill mid-run is refused now, naming what lowers it
        check_step_memory(cfg, train_rows=inputs.train_rows)
    _seed_everything(tc.seed)
    keep_freed_memory()  # activation tensors reuse heap blocks instead of faulting in fresh pages
    if tc.heap_mmap_threshold_mib is not None:  # ...up to this size: larger ones are mapped and returned
        set_mmap_threshold(tc.heap_mmap_threshold_mib)
    run_dir = prepare_output_dir(cfg, inputs.resume_from)  # also removes what a killed checkpoint left
    with open(os.path.join(run_dir, "config.yaml"), "w", encoding="utf-8") as f:
        yaml.safe_dump(unstructure(cfg), f, sort_keys=False)

    # --- setup: data, model, algorithm, runtimes ------------------------------------------------
    train_rows = inputs.train_rows
    eval_rows = inputs.eval_rows[: cfg.data.eval_size]  # eval_size None: all
    sampler = PromptSampler(train_rows, seed=tc.seed, shuffle=cfg.data.shuffle)

    model = resolve_model(cfg.model, pm)
    codec = ChatCodec(load_tokenizer(model))
    policy_loss = build_selected(pm, "policy_loss", cfg.algorithm.policy_loss)
    # the loss's own loss_reduction option, else algorithm.loss_reduction, else the loss's default
    loss_reduction = effective_loss_reduction(cfg.algorithm.loss_reduction, getattr(policy_loss, "options", None))
    estimator = build_selected(pm, "advantage_estimator", cfg.algorithm.advantage)
    # gae needs a critic; a critic needs an estimator that reads it (and a checkpoint that holds it)
    check_critic_choice(estimator, cfg, inputs.resume_from if tc.resume else None)
    kl_cfg = cfg.algorithm.kl
    use_kl = kl_cfg.use_as != "none" and (kl_cfg.coef > 0 or kl_cfg.adaptive_target is not None)
    kl_ctl = (AdaptiveKLController(kl_cfg.coef, kl_cfg.adaptive_target, kl_cfg.adaptive_horizon)
              if kl_cfg.adaptive_target is not None else FixedKLController(kl_cfg.coef))

    # Runtimes (and Ray ranks, engine processes) are closed however the run ends.
    with contextlib.ExitStack() as closing:
        # An error names the step and phase it stopped (after the runtimes below are closed).
        activity = RunActivity(os.path.join(run_dir, METRICS_FILE), passes_through=(NonFiniteTrainingError,))
        closing.push(activity.on_exit)
        closing.callback(set_trainer_computing, False)
        # Plugins adopt the run's config first: IsoExec must be on before runtimes install their ops;
        # they give it back last, after the runtimes are closed, however the run ends.
        closing.callback(pm.hook.skyrl_on_run_exit, run_dir=run_dir)
        pm.hook.skyrl_on_run_start(config=cfg, run_dir=run_dir)
        # engine.placement=separate: a Ray placement group for the trainer ranks and the engine processes
        placement = start_placement(cfg.engine)
        if placement is not None:
            closing.callback(placement.close)
        backend = closing.enter_context(contextlib.closing(build_backend(pm, cfg, model)))
        if placement is not None and placement.strategy == "disaggregate" and not placement.trainer_placed:
            raise RuntimeError(f"engine.ray_placement='disaggregate': backend {cfg.backend.name!r} started no Ray rank "
                               "actors to place on the trainer's node; use ray_placement=colocate")
        engine = closing.enter_context(contextlib.closing(build_engine(pm, cfg, model, placement=placement,
                                                                       run_dir=run_dir)))
        critic = Critic(cfg, model) if cfg.algorithm.critic.enabled else None
        if distill.teacher is not None:  # the teacher replaces the reference (a KL term then pulls to it)
            teacher = attrs.evolve(model, path=os.path.abspath(os.path.expanduser(distill.teacher)), config=None,
                                   tokenizer=None)
            reference = ReferencePolicy(teacher, seed=tc.seed, trainer=tc)
        else:
            reference = ReferencePolicy(model, seed=tc.seed, trainer=tc) if use_kl else None
        generator = RolloutGenerator(
            engine, codec, EnvironmentFactory(pm, cfg.environment.name, cfg.environment.options),
            max_turns=cfg.rollout.max_turns, max_prompt_tokens=cfg.rollout.max_prompt_tokens,
            max_response_tokens=cfg.rollout.max_response_tokens, env_workers=cfg.rollout.env_workers,
        )
        gen = cfg.generation
        train_sampling = Sampling(n=gen.n_samples, max_new_tokens=gen.max_new_tokens, temperature=gen.temperature,
                                  top_p=gen.top_p, top_k=gen.top_k, stop=gen.stop)
        eval_sampling = attrs.evolve(train_sampling, n=gen.eval_n_samples, temperature=gen.eval_temperature)

        # --- resume ---------------------------------------------------------------------------------
        start_step, history = 0, []
        if tc.resume:
            state = ckpt.load_checkpoint(inputs.resume_from, backend, critic)
            start_step, history = int(state["step"]), state["history"]
            sampler.load_state(state["sampler"])
            kl_ctl.value = float(state["kl_coef"])
        log = MetricsLog(run_dir, history)
        progress = Progress(enabled=tc.progress, total=tc.steps, initial=start_step)
        closing.callback(progress.close)

        # The engine starts from the backend's weights (fresh or restored), after the handshake.
        # A plugin (IsoExec) may vouch that the engine's logprobs are the trainer's bits: see step 2.
        verdict = handshake(pm, backend, engine)
        load_policy(engine, generator, backend.export_weights(), start_step)  # version = steps trained
        # Where each step's rollouts come from: generated now (sync), during the previous step
        # (one_step_off), or by workers that never wait for the trainer (fully_async): async_rl.py.
        rollouts = closing.enter_context(contextlib.closing(make_rollout_source(
            cfg, engine=engine, generator=generator, sampler=sampler, sampling=train_sampling,
            collect_step=lambda step: _collect_rollouts(
                step, cfg, sampler, lambda rows, seed, prefix: _generate(generator, progress, rows, train_sampling,
                                                                         seed, prefix)))))
        skip_old_logprobs = tc.reuse_rollout_logprobs or verdict.reuse_rollout_logprobs
        # One optimizer step per rollout, nothing that needs old logprobs before training: see step 2.
        single_update = (tc.ppo_epochs == 1 and tc.mini_batches == 1 and kl_cfg.use_as != "reward"
                         and cfg.algorithm.off_policy == OffPolicyConfig())

        def run_eval(step: int) -> dict[str, float]:
            if not eval_rows:
                return {}
            started = time.perf_counter()
            with progress.task("eval", len(eval_rows)) as advance:
                metrics = evaluate(generator, eval_rows, eval_sampling, seed=request_seed(tc.seed, "eval"),
                                   on_chunk=advance)
            metrics["time/eval"] = time.perf_counter() - started
            pm.hook.skyrl_on_eval_end(step=step, metrics=metrics)
            shown = _fmt(metrics, accuracy="eval/accuracy", **{f"pass@{eval_sampling.n}": f"eval/pass@{eval_sampling.n}"},
                         length="eval/response_length")
            progress.say(f"eval @ step {step}: {shown}")
            return metrics

        if start_step == 0 and eval_rows:
            log.write({"step": 0, **run_eval(0)})

        # --- the loop -------------------------------------------------------------------------------
        for step in range(start_step + 1, tc.steps + 1):
            timings: dict[str, float] = {}
            started = time.perf_counter()

            activity.now(step, "generating rollouts")
            set_trainer_computing(False)
            # 1. rollouts: n episodes per prompt, rewards from the environments (dynamic sampling may
            #    drop groups without signal, and roll out more prompts to refill the step)
            trajectories, samples, sampling_metrics = rollouts.collect(step)
            timings["time/rollout"] = time.perf_counter() - started
            set_trainer_computing(True)  # (generation beside it, in the async modes, takes fewer threads)
            metrics: dict[str, Any] = {"step": step, **_rollout_metrics(trajectories), **sampling_metrics}

            if samples:
                batch = build_training_batch(samples, codec.pad_token_id)
                if tc.engine_sleep:  # the KV cache is not needed again before the next generation
                    engine.sleep()
                release_freed_memory()  # the rollout's freed heap blocks go back before training allocates

                activity.now(step, "computing old logprobs (and reference logprobs)")
                # 2. old logprobs: the trainer's logprobs of the sampled tokens under the sampling policy.
                #    - IsoExec (or trainer.reuse_rollout_logprobs): the engine's are the trainer's; step 1
                #      computes them anyway, so the log shows the mismatch the skip relies on;
                #    - a single update per rollout: the training forward's own (detached) logprobs are
                #      them, so the loss takes them from there (None here) and measures the mismatch;
                #    - otherwise: a forward pass.
                t = time.perf_counter()
                if skip_old_logprobs and step != 1:
                    old_logprobs = batch.rollout_logprobs
                elif single_update:
                    old_logprobs = None
                else:
                    old_logprobs = backend.forward(batch)
                timings["time/old_logprobs"] = time.perf_counter() - t
                ref_logprobs = reference.forward(batch) if reference is not None else None

                activity.now(step, "computing rewards and advantages")
                # 3. rewards and advantages (KL as a reward penalty goes in here)
                rewards = token_rewards(samples, batch.loss_mask)
                if use_kl and kl_cfg.use_as == "reward":
                    kl = kl_estimate(old_logprobs, ref_logprobs, kl_cfg.estimator) * batch.loss_mask
                    rewards = apply_kl_penalty(rewards, kl, kl_ctl.value, batch.loss_mask)
                    metrics["kl"] = float(kl.sum() / batch.loss_mask.sum().clamp(min=1))
                values = critic.values(batch) if critic is not None else None
                advantages, returns = _advantages(estimator, samples, rewards, batch, values)
                if distill.teacher is not None:  # student logprobs: old ones, else the engine's (same policy)
                    student = old_logprobs if old_logprobs is not None else batch.rollout_logprobs
                    advantages, distill_metrics = distillation_advantages(
                        advantages, ref_logprobs, student, batch.loss_mask, coef=distill.coef,
                        reward_coef=distill.reward_coef)
                    metrics.update(distill_metrics)
                multiplier = batch.loss_mask
                if old_logprobs is not None and old_logprobs is not batch.rollout_logprobs:
                    multiplier, mismatch = off_policy_correction(old_logprobs, batch.rollout_logprobs, batch.loss_mask,
                                                                 cfg.algorithm.off_policy)
                    metrics.update(mismatch)
                batch = attrs.evolve(batch, old_logprobs=old_logprobs, ref_logprobs=ref_logprobs,
                                     advantages=advantages, returns=returns, values=values)

                activity.now(step, "training (forward_backward and optimizer steps)")
                # 4. PPO epochs over mini-batches; each mini-batch is one optimizer step
                t = time.perf_counter()
                kl_loss_coef = kl_ctl.value if use_kl and kl_cfg.use_as == "loss" else 0.0
                loss_fn = RLLoss(policy_loss=policy_loss, kl_coef=kl_loss_coef, kl_estimator=kl_cfg.estimator,
                                 entropy_coef=cfg.algorithm.entropy_coef)
                norm_len = getattr(getattr(policy_loss, "options", None), "norm_len", None)
                train_metrics: list[dict[str, float]] = []
                for _epoch in range(tc.ppo_epochs):
                    for rows_of_mini in _mini_batches(len(batch), tc.mini_batches):
                        mini = batch.select(rows_of_mini)
                        weights = reduction_weights(mini.loss_mask, loss_reduction, mini.group_ids, norm_len,
                                                    micro_batch_size=tc.micro_batch_size)
                        mini = attrs.evolve(mini, token_weights=weights * multiplier[rows_of_mini])
                        # the backend packs the mini-batch into micro-batches and reduces their metrics
                        trained = backend.forward_backward(mini, loss_fn)
                        check_finite(step, "loss", trained.get("loss"))  # before the optimizer step
                        stepped = backend.optim_step()  # skips the update on a non-finite gradient norm
                        check_finite(step, "gradient norm", stepped.get("grad_norm"))
                        critic_metrics = critic.train_step(mini) if critic is not None else {}
                        train_metrics.append({**trained, **stepped, **critic_metrics})
                metrics.update(_mean_metrics(train_metrics))
                timings["time/train"] = time.perf_counter() - t
                if use_kl:
                    kl_ctl.update(metrics.get("kl", 0.0), len(batch))
                    metrics["kl_coef"] = kl_ctl.value

                activity.now(step, "syncing weights to the engine")
                if tc.engine_sleep:
                    engine.wake()
                release_freed_memory()  # training's freed blocks go back before the weights are copied
                # 5. contract handshake, then weight sync to the engine
                t = time.perf_counter()
                set_trainer_computing(False)  # a sync may first wait for the generation beside it
                handshake(pm, backend, engine)
                rollouts.sync_weights(step, backend.export_weights)
                timings["time/weight_sync"] = time.perf_counter() - t
            else:
                metrics["skipped"] = 1.0  # every group had equal rewards: nothing to learn from

            if hasattr(engine, "restarts"):  # separate engine processes restarted after a failure, so far
                metrics["engine/restarts"] = float(engine.restarts)
            timings["time/step"] = time.perf_counter() - started
            metrics.update(timings)

            activity.now(step, "evaluating")
            # 6. evaluation every k steps and at the end
            if eval_rows and ((tc.eval_every and step % tc.eval_every == 0) or step == tc.steps):
                metrics.update(run_eval(step))
            log.write(metrics)
            pm.hook.skyrl_on_step_end(step=step, metrics=dict(metrics))
            progress.step(step, _fmt(metrics, reward="reward/mean", accuracy="accuracy", length="response_length/mean",
                                     loss="loss", grad_norm="grad_norm", mismatch_max="mismatch/abs_logprob_diff_max",
                                     seconds="time/step"))

            release_freed_memory()

            activity.now(step, "saving a checkpoint")
            # 7. checkpoint every k steps and at the end
            if (tc.checkpoint_every and step % tc.checkpoint_every == 0) or step == tc.steps:
                state = {"sampler": rollouts.sampler_state(), "kl_coef": kl_ctl.value, "history": log.history}
                check_weights_finite(step, backend.export_weights())
                path = ckpt.save_checkpoint(run_dir, step, backend, state, critic)
                pm.hook.skyrl_on_checkpoint(step=step, path=path)

        # --- the end --------------------------------------------------------------------------------
        if tc.plot:
            plot_metrics(log, os.path.join(run_dir, PLOT_FILE))
        before, after = _evals_of_this_run(log.history, start_step)
        print(_run_summary(run_dir, log.history, start_step, before, after, len(eval_rows), tc.plot), flush=True)
        before, after = _eval_part(before), _eval_part(after)
        final = log.history[-1] if log.history else {}
        pm.hook.skyrl_on_run_end(metrics=dict(final), run_dir=run_dir)
        return RunResult(run_dir=run_dir, history=log.history, eval_before=before, eval_after=after)


# --- helpers, in the order the loop uses them ------------------------------------------------------


def _seed_everything(seed: int) -> None:
    import numpy as np

    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def _rollout_metrics(trajectories: list[Trajectory]) -> dict[str, float]:
    rewards = [t.reward for t in trajectories]
    lengths = [t.model_token_count for t in trajectories]
    mean = sum(rewards) / len(rewards)
    groups: dict[str, list[float]] = {}
    for t in trajectories:
        groups.setdefault(t.group_id, []).append(t.reward)
    return {
        "reward/mean": mean,
        "reward/std": math.sqrt(sum((r - mean) ** 2 for r in rewards) / len(rewards)),
        "accuracy": sum(t.correct for t in trajectories) / len(trajectories),
        "response_length/mean": sum(lengths) / len(lengths),
        "response_length/max": float(max(lengths)),
        "truncated_frac": sum(t.stop_reason != "stop" for t in trajectories) / len(trajectories),
        "turns/mean": sum(t.num_turns for t in trajectories) / len(trajectories),
        "groups/uniform_reward_frac": sum(len(set(g)) == 1 for g in groups.values()) / len(groups),
    }


def _generate(generator: RolloutGenerator, progress: Progress, rows: list, sampling: Sampling, seed: int,
              group_prefix: str) -> list:
    with progress.task("rollout", len(rows) * sampling.n) as advance:
        return generator.generate(rows, sampling, seed=seed, group_prefix=group_prefix,
                                  on_turn=lambda turn, done: advance(done))


def _collect_rollouts(
    step: int, cfg: Config, sampler: PromptSampler, generate: Any
) -> tuple[list[Trajectory], list[TrainingSample], dict[str, float]]:
    """One step's trajectories, training samples and dynamic-sampling metrics.

    ``algorithm.dynamic_sampling.mode``: ``none`` trains on every group; ``drop`` drops the groups
    whose rewards are all equal (within ``zero_variance_tol``); ``resample`` also rolls out further
    batches of ``prompts_per_step`` prompts until that many groups carry signal or
    ``max_sample_batches`` batches were rolled out, and trains on the first ``prompts_per_step``
    such groups. Extra batches get their own seeds and group ids, so a resumed run repeats them."""
    ds, want = cfg.algorithm.dynamic_sampling, cfg.data.prompts_per_step
    trajectories: list[Trajectory] = []
    samples: list[TrainingSample] = []
    generated = batches = 0
    while True:
        batches += 1
        tag = (step,) if batches == 1 else (step, batches)  # the first batch: the step's own seed, as without resampling
        new = generate(sampler.next_rows(want), request_seed(cfg.trainer.seed, "train", *tag),
                       ".".join(map(str, tag)) + ":")
        trajectories += new
        new_samples = training_samples(new, stepwise=cfg.rollout.stepwise)
        generated += len(new_samples)
        if ds.mode != "none" and new_samples:
            keep = zero_variance_group_mask([s.reward for s in new_samples], [s.group_id for s in new_samples],
                                            ds.zero_variance_tol)
            new_samples = [s for s, kept in zip(new_samples, keep.tolist()) if kept]
        samples += new_samples
        groups = list(dict.fromkeys(s.group_id for s in samples))
        if ds.mode != "resample" or len(groups) >= want or batches >= ds.max_sample_batches:
            break
    if ds.mode == "none":
        return trajectories, samples, {}
    if ds.mode == "resample":
        chosen = set(groups[:want])
        samples = [s for s in samples if s.group_id in chosen]
    return trajectories, samples, {
        "dynamic_sampling/kept_frac": len(samples) / max(generated, 1),
        "dynamic_sampling/batches": float(batches),
        "dynamic_sampling/groups": float(len(dict.fromkeys(s.group_id for s in samples))),
    }


def _advantages(
    estimator: AdvantageEstimator, samples: list[TrainingSample], rewards: torch.Tensor, batch: TrainingBatch,
    values: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Advantages and returns ``[B, R]`` (``values``: the critic's, for ``gae``). Step-wise samples:
    estimated on each episode's last step (one per episode, so groups count episodes, not turns),
    then given to its earlier steps."""
    mask = batch.loss_mask
    if all(s.is_last_step for s in samples):
        return estimator(rewards, mask, batch.group_ids, values)
    last = [i for i, s in enumerate(samples) if s.is_last_step]
    adv_last, ret_last = estimator(rewards[last], mask[last], [batch.group_ids[i] for i in last],
                                   values[last] if values is not None else None)
    first_token = mask[last].argmax(dim=-1)
    rows = torch.arange(len(last))
    per_episode_adv = dict(zip((samples[i].trajectory_id for i in last), adv_last[rows, first_token].tolist()))
    per_episode_ret = dict(zip((samples[i].trajectory_id for i in last), ret_last[rows, first_token].tolist()))
    adv = torch.tensor([per_episode_adv[s.trajectory_id] for s in samples]).unsqueeze(-1) * mask
    ret = torch.tensor([per_episode_ret[s.trajectory_id] for s in samples]).unsqueeze(-1) * mask
    return adv, ret


def _mini_batches(rows: int, count: int) -> list[list[int]]:
    """``count`` contiguous, near-equal row ranges (fewer when there are fewer rows)."""
    count = min(count, rows)
    bounds = [round(i * rows / count) for i in range(count + 1)]
    return [list(range(bounds[i], bounds[i + 1])) for i in range(count)]


def _mean_metrics(records: list[dict[str, float]]) -> dict[str, float]:
    out: dict[str, float] = {}
    for key in dict.fromkeys(k for r in records for k in r):
        values = [r[key] for r in records if key in r]
        out[key] = values[-1] if key == "lr" else sum(values) / len(values)
    return out


def _evals_of_this_run(history: list[dict[str, Any]], start_step: int) -> tuple[dict[str, Any], dict[str, Any]]:
    """The eval records this run went from and to: the last one at or before the step it started
    from (step 0's, or the resumed checkpoint's) and its last one after; ``{}`` where there is none."""
    evals = [r for r in history if "eval/accuracy" in r]
    before = [r for r in evals if r["step"] <= start_step]
    after = [r for r in evals if r["step"] > start_step]
    return (before[-1] if before else {}), (after[-1] if after else {})


def _run_summary(run_dir: str, history: list[dict[str, Any]], start_step: int, before: dict[str, Any],
                 after: dict[str, Any], eval_prompts: int, plotted: bool) -> str:
    """What the run did and where everything went, printed at its end."""
    steps = [r["step"] for r in history if r["step"] > start_step]
    did = f"steps {steps[0]}-{steps[-1]}" if steps else "no steps"
    lines = [f"run finished: {did}" + (f" (resumed from step {start_step})" if start_step else "")]
    if before and after:
        lines.append(f"held-out accuracy: {before['eval/accuracy']:.3f} at step {before['step']} -> "
                     f"{after['eval/accuracy']:.3f} at step {after['step']} ({eval_prompts} prompts)")
    elif after:
        lines.append(f"held-out accuracy: {after['eval/accuracy']:.3f} at step {after['step']} ({eval_prompts} prompts)")
    try:
        checkpoint = ckpt.resolve_checkpoint(run_dir)
    except FileNotFoundError:
        checkpoint = None
    where = [("run directory", run_dir), ("config", os.path.join(run_dir, "config.yaml")),
             ("metrics", os.path.join(run_dir, METRICS_FILE)),
             ("plot", os.path.join(run_dir, PLOT_FILE) if plotted else None),
             ("last checkpoint", checkpoint)]
    lines += [f"  {label + ':':<17}{path}" for label, path in where if path and os.path.exists(path)]
    return "\n".join(lines)


def _eval_part(record: dict[str, Any]) -> dict[str, float]:
    return {k: v for k, v in record.items() if k.startswith("eval/")}


def _fmt(metrics: dict[str, Any], **shown: str) -> str:
    """``label=value`` for each ``label=metric key`` present in ``metrics``."""
    return " ".join(f"{label}={metrics[key]:.4g}" for label, key in shown.items() if metrics.get(key) is not None)
