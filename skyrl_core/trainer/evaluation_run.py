"""``skyrl eval CONFIG [checkpoint=DIR]``: evaluation only, with the trainer's own evaluation.

The model is the config's (``model.path`` or a random ``model.config``), or the policy of a
training checkpoint: then the configured backend is built, restores the checkpoint, and hands its
weights to the engine after the execution-contract handshake, exactly as the trainer does after a
resume. The eval rows, sampling (``generation.eval_temperature``, ``eval_n_samples``, ...) and
request seeds are the trainer's, so an evaluation of the checkpoint of step k reproduces the
``eval/*`` metrics the trainer logged at step k (with a deterministic engine).

Results: a JSON file (``--output``; default ``<trainer.output_dir>/eval_<checkpoint or model>.json``)
and a one-line summary.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from typing import TYPE_CHECKING

import attrs

from skyrl_core.config.schema import Config

if TYPE_CHECKING:
    from skyrl_core.plugins.manager import SkyrlPluginManager


@attrs.frozen
class EvalReport:
    metrics: dict[str, float]
    output: str
    checkpoint: str | None
    step: int | None
    prompts: int
    samples_per_prompt: int

    def summary(self) -> str:
        shown = " ".join(f"{k.removeprefix('eval/')}={v:.4g}" for k, v in self.metrics.items() if k != "time/eval")
        source = f"checkpoint step {self.step}" if self.checkpoint else "configured model"
        return (f"eval ({source}, {self.prompts} prompts x {self.samples_per_prompt} samples): {shown} -> {self.output}")


def run_evaluation(cfg: Config, *, checkpoint: str | None = None, output: str | None = None,
                   plugin_manager: SkyrlPluginManager | None = None) -> EvalReport:
    """Evaluate ``cfg``'s model, or the checkpoint ``checkpoint`` (a checkpoint directory or a run
    directory, whose latest checkpoint is taken) on ``data.eval``; write and return the report."""
    from skyrl_core.models import load_tokenizer
    from skyrl_core.plugins.manager import get_plugin_manager
    from skyrl_core.rollout import ChatCodec, EnvironmentFactory, RolloutGenerator, Sampling, request_seed
    from skyrl_core.trainer import checkpoint as ckpt
    from skyrl_core.trainer.evaluate import evaluate
    from skyrl_core.trainer.preflight import check_eval_inputs
    from skyrl_core.trainer.rl import _seed_everything
    from skyrl_core.trainer.runtime import build_backend, build_engine, handshake, resolve_model

    pm = plugin_manager or get_plugin_manager()
    rows, checkpoint_dir = check_eval_inputs(cfg, checkpoint, plugin_manager=pm)
    state = ckpt.read_trainer_state(checkpoint_dir) if checkpoint_dir else None
    label = os.path.basename(checkpoint_dir) if checkpoint_dir else "model"
    out_path = os.path.abspath(os.path.expanduser(
        output or os.path.join(cfg.trainer.output_dir, f"eval_{label}.json")))
    _seed_everything(cfg.trainer.seed)
    model = resolve_model(cfg.model, pm)
    codec = ChatCodec(load_tokenizer(model))
    gen = cfg.generation
    sampling = Sampling(n=gen.eval_n_samples, max_new_tokens=gen.max_new_tokens, temperature=gen.eval_temperature,
                        top_p=gen.top_p, top_k=gen.top_k, stop=gen.stop)
    with contextlib.ExitStack() as closing:
        # Plugins adopt the config (IsoExec switches on here); loggers are the training runs' only.
        quiet = attrs.evolve(cfg, trainer=attrs.evolve(cfg.trainer, loggers=("jsonl",)))
        closing.callback(pm.hook.skyrl_on_run_exit, run_dir=os.path.dirname(out_path))  # after the engine closes
        pm.hook.skyrl_on_run_start(config=quiet, run_dir=os.path.dirname(out_path))
        engine = closing.enter_context(contextlib.closing(build_engine(pm, cfg, model)))
        if checkpoint_dir is not None:
            with contextlib.closing(build_backend(pm, cfg, model)) as backend:
                ckpt.load_checkpoint(checkpoint_dir, backend)
                handshake(pm, backend, engine)
                engine.update_weights(backend.export_weights())
        generator = RolloutGenerator(
            engine, codec, EnvironmentFactory(pm, cfg.environment.name, cfg.environment.options),
            max_turns=cfg.rollout.max_turns, max_prompt_tokens=cfg.rollout.max_prompt_tokens,
            max_response_tokens=cfg.rollout.max_response_tokens, env_workers=cfg.rollout.env_workers,
        )
        started = time.perf_counter()
        metrics = evaluate(generator, rows, sampling, seed=request_seed(cfg.trainer.seed, "eval"))
        metrics["time/eval"] = time.perf_counter() - started
    report = EvalReport(metrics=metrics, output=out_path, checkpoint=checkpoint_dir,
                        step=int(state["step"]) if state else None, prompts=len(rows),
                        samples_per_prompt=sampling.n)
    os.makedirs(os.path.dirname(out_path), exist_ok=True)
    with open(out_path, "w", encoding="utf-8") as f:
        json.dump({"metrics": metrics, "checkpoint": checkpoint_dir, "step": report.step,
                   "model": model.path, "engine": cfg.engine.name, "data": cfg.data.eval,
                   "prompts": len(rows), "samples_per_prompt": sampling.n,
                   "temperature": sampling.temperature, "seed": cfg.trainer.seed}, f, indent=2, sort_keys=True)
    return report
