"""Supervised fine-tuning (``skyrl sft CONFIG``) on the RL trainer's backends and config.

Each step draws ``sft.batch_size`` conversations (``data.train``, epoch after epoch, order fixed by
the seed), renders them with the chat template (``skyrl_core.data_chat``), and takes one optimizer
step on the token-mean negative log-likelihood of the assistant tokens (the core's
``cross_entropy`` policy loss, weighted by ``1 / trained tokens``), through the backend's
``forward_backward`` (which forms its own micro-batches). With ``sft.pack`` conversations are
packed into rows of up to ``sft.max_length`` tokens: position ids restart at every conversation
and attention stays inside it, so a packed row scores each conversation as if it were alone.

Every ``trainer.eval_every`` steps (and before the first and after the last) ``eval/loss`` is the
token-mean NLL over ``data.eval``. Outputs in ``trainer.output_dir``: ``config.yaml``,
``metrics.jsonl`` (and the selected loggers), ``metrics.png`` (train and eval loss),
``checkpoints/`` (exact resume with ``trainer.resume``, as in RL training) and ``hf/``, a Hugging
Face model directory transformers and vLLM load.
"""

from __future__ import annotations

import contextlib
import os
import time
from typing import TYPE_CHECKING, Any, Sequence

import attrs
import torch
import yaml

from skyrl_core.config.errors import ConfigError, ConfigIssue
from skyrl_core.data import DatasetError
from skyrl_core.data_chat import ChatSample, load_chat_dataset, render_chat
from skyrl_core.types import TrainingBatch

if TYPE_CHECKING:
    from skyrl_core.config.schema import Config
    from skyrl_core.plugins.manager import SkyrlPluginManager

HF_DIR = "hf"


@attrs.frozen
class SFTResult:
    run_dir: str
    history: list[dict[str, Any]]
    hf_dir: str | None


# --- batches ---------------------------------------------------------------------------------------


def pack_rows(lengths: Sequence[int], max_length: int) -> list[list[int]]:
    """Sample indices of each packed row: first fit, in the given order, at most ``max_length`` tokens a row."""
    rows: list[list[int]] = []
    room: list[int] = []
    for index, length in enumerate(lengths):
        for r, left in enumerate(room):
            if length <= left:
                rows[r].append(index)
                room[r] -= length
                break
        else:
            rows.append([index])
            room.append(max_length - length)
    return rows


def build_sft_batch(samples: Sequence[ChatSample], pad_token_id: int, *, pack: bool, max_length: int) -> tuple[TrainingBatch, list[list[int]]]:
    """The training batch of ``samples`` and which samples each row holds.

    Layout (``TrainingBatch``): one prompt token (a row's first token) then the rest as the
    "response", so ``loss_mask[:, j]`` is the mask of token ``j + 1``. Packed rows carry
    ``position_ids`` that restart at 0 for every sample (the backend derives the block-diagonal
    attention from them); padding continues the last sample's positions and is never trained."""
    groups = pack_rows([len(s) for s in samples], max_length) if pack else [[i] for i in range(len(samples))]
    width = max(sum(len(samples[i]) for i in g) for g in groups)
    B = len(groups)
    input_ids = torch.full((B, width), pad_token_id, dtype=torch.long)
    attention = torch.zeros((B, width), dtype=torch.long)
    mask = torch.zeros((B, width), dtype=torch.float32)
    positions = torch.zeros((B, width), dtype=torch.long)
    for row, group in enumerate(groups):
        start = 0
        for i in group:
            s = samples[i]
            n = len(s)
            input_ids[row, start:start + n] = torch.tensor(s.input_ids)
            mask[row, start:start + n] = torch.tensor(s.loss_mask, dtype=torch.float32)
            positions[row, start:start + n] = torch.arange(n)
            start += n
        attention[row, :start] = 1
        last = int(positions[row, start - 1])
        positions[row, start:] = torch.arange(last + 1, last + 1 + width - start)
    batch = TrainingBatch(input_ids=input_ids, attention_mask=attention, loss_mask=mask[:, 1:].contiguous(),
                          position_ids=positions if pack else None)
    return batch, groups


def sample_logprobs(logprobs: torch.Tensor, samples: Sequence[ChatSample], groups: list[list[int]]) -> list[torch.Tensor]:
    """Per sample, the logprobs ``[len - 1]`` of its tokens after the first, cut from the batch's
    ``[B, R]`` (``build_sft_batch``'s layout)."""
    out: list[torch.Tensor | None] = [None] * len(samples)
    for row, group in enumerate(groups):
        start = 0
        for i in group:
            n = len(samples[i])
            out[i] = logprobs[row, start:start + n - 1]  # token k of the row sits at response column k - 1
            start += n
    return out  # type: ignore[return-value]


def token_mean_weights(batch: TrainingBatch) -> TrainingBatch:
    """``batch`` with ``token_weights = loss_mask / trained tokens``: its loss is the token-mean NLL."""
    return attrs.evolve(batch, token_weights=batch.loss_mask / batch.loss_mask.sum().clamp(min=1))


# --- inputs ----------------------------------------------------------------------------------------


@attrs.frozen
class SFTInputs:
    train: list[ChatSample]
    eval: list[ChatSample]
    resume_from: str | None


def check_sft_inputs(cfg: Config, *, plugin_manager: SkyrlPluginManager) -> SFTInputs:
    """Datasets parsed and rendered (every conversation within ``sft.max_length``), model, resume
    checkpoint, output directory, components: every problem at once, as a ``ConfigError``."""
    from skyrl_core.models import load_tokenizer
    from skyrl_core.trainer.preflight import _check_model, check_run_location
    from skyrl_core.trainer.runtime import resolve_model

    options = cfg.plugins["sft"]
    issues: list[ConfigIssue] = []
    _check_model(issues, cfg, plugin_manager)
    tokenizer = None if issues else load_tokenizer(resolve_model(cfg.model, plugin_manager))
    rendered: dict[str, list[ChatSample]] = {"train": [], "eval": []}
    for key in ("train", "eval"):
        path = getattr(cfg.data, key)
        if path is None:
            if key == "train":
                issues.append(ConfigIssue("data.train", "is not set: give a chat dataset (rows of messages; .jsonl, .json, .parquet)"))
            continue
        try:
            rows = load_chat_dataset(os.path.expanduser(path))
            if key == "eval":
                rows = rows[: cfg.data.eval_size]
            if not rows:
                issues.append(ConfigIssue(f"data.{key}", f"{path!r} has no rows"))
            if tokenizer is not None:
                for index, row in enumerate(rows):
                    sample = render_chat(tokenizer, row["messages"], options.loss_on, where=f"{path}: row {index}")
                    if len(sample) > options.max_length:
                        issues.append(ConfigIssue(f"data.{key}", f"{path}: row {index} renders to {len(sample)} tokens, "
                                                  f"more than sft.max_length={options.max_length}"))
                        break
                    rendered[key].append(sample)
        except DatasetError as exc:
            issues.append(ConfigIssue(f"data.{key}", str(exc)))
    resume_from = check_run_location(issues, cfg, plugin_manager)
    if issues:
        raise ConfigError(issues)
    return SFTInputs(train=rendered["train"], eval=rendered["eval"], resume_from=resume_from)


# --- the loop --------------------------------------------------------------------------------------


def sft(cfg: Config, *, plugin_manager: SkyrlPluginManager | None = None) -> SFTResult:
    """Run supervised fine-tuning as ``cfg`` says; return the metrics history and the exported directory."""
    from skyrl_core.algorithms.policy_losses import make_cross_entropy
    from skyrl_core.config.loader import unstructure
    from skyrl_core.plugins.manager import get_plugin_manager
    from skyrl_core.trainer import checkpoint as ckpt
    from skyrl_core.trainer.loss import RLLoss
    from skyrl_core.trainer.metrics import PLOT_FILE, MetricsLog
    from skyrl_core.trainer.preflight import prepare_output_dir
    from skyrl_core.trainer.progress import Progress
    from skyrl_core.trainer.rl import _seed_everything
    from skyrl_core.trainer.runtime import build_backend, resolve_model
    from skyrl_core.trainer.sampler import PromptSampler

    pm = plugin_manager or get_plugin_manager()
    tc, options = cfg.trainer, cfg.plugins["sft"]
    inputs = check_sft_inputs(cfg, plugin_manager=pm)
    _seed_everything(tc.seed)
    run_dir = prepare_output_dir(cfg, inputs.resume_from)
    with open(os.path.join(run_dir, "config.yaml"), "w", encoding="utf-8") as f:
        yaml.safe_dump(unstructure(cfg), f, sort_keys=False)
    model = resolve_model(cfg.model, pm)
    from skyrl_core.models import load_tokenizer

    tokenizer = load_tokenizer(model)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    indexed = [{"index": i} for i in range(len(inputs.train))]
    sampler = PromptSampler(indexed, seed=tc.seed, shuffle=cfg.data.shuffle)
    loss_fn = RLLoss(policy_loss=make_cross_entropy())

    def batch_of(samples: Sequence[ChatSample]) -> TrainingBatch:
        return build_sft_batch(samples, pad_id, pack=options.pack, max_length=options.max_length)[0]

    with contextlib.ExitStack() as closing:
        closing.callback(pm.hook.skyrl_on_run_exit, run_dir=run_dir)  # after the runtimes close
        pm.hook.skyrl_on_run_start(config=cfg, run_dir=run_dir)
        backend = closing.enter_context(contextlib.closing(build_backend(pm, cfg, model)))
        if options.pack and not getattr(backend, "packed_rows", False):
            raise ConfigError([ConfigIssue("sft.pack", f"backend {cfg.backend.name!r} does not score packed rows "
                                           "(position ids per conversation); set sft.pack=false")])
        start_step, history = 0, []
        if tc.resume:
            state = ckpt.load_checkpoint(inputs.resume_from, backend)
            start_step, history = int(state["step"]), state["history"]
            sampler.load_state(state["sampler"])
        log = MetricsLog(run_dir, history)
        progress = Progress(enabled=tc.progress, total=tc.steps, initial=start_step)
        closing.callback(progress.close)

        def run_eval(step: int) -> dict[str, float]:
            if not inputs.eval:
                return {}
            started = time.perf_counter()
            total = tokens = 0.0
            for begin in range(0, len(inputs.eval), options.batch_size):
                batch = batch_of(inputs.eval[begin:begin + options.batch_size])
                logprobs = backend.forward(batch)
                total += float(-(logprobs * batch.loss_mask).sum())
                tokens += float(batch.loss_mask.sum())
            metrics = {"eval/loss": total / max(tokens, 1.0), "time/eval": time.perf_counter() - started}
            pm.hook.skyrl_on_eval_end(step=step, metrics=dict(metrics))
            progress.say(f"eval @ step {step}: loss={metrics['eval/loss']:.4f}")
            return metrics

        if start_step == 0 and inputs.eval:
            log.write({"step": 0, **run_eval(0)})
        for step in range(start_step + 1, tc.steps + 1):
            started = time.perf_counter()
            samples = [inputs.train[row["index"]] for row in sampler.next_rows(options.batch_size)]
            batch = token_mean_weights(batch_of(samples))
            metrics: dict[str, Any] = {"step": step, **backend.forward_backward(batch, loss_fn)}
            metrics.update(backend.optim_step())
            metrics.update({"tokens": float(batch.loss_mask.sum()), "rows": float(len(batch)),
                            "time/step": time.perf_counter() - started})
            if inputs.eval and ((tc.eval_every and step % tc.eval_every == 0) or step == tc.steps):
                metrics.update(run_eval(step))
            log.write(metrics)
            pm.hook.skyrl_on_step_end(step=step, metrics=dict(metrics))
            progress.step(step, " ".join(f"{k}={metrics[k]:.4g}" for k in ("loss", "eval/loss", "grad_norm", "lr")
                                         if metrics.get(k) is not None))
            if (tc.checkpoint_every and step % tc.checkpoint_every == 0) or step == tc.steps:
                path = ckpt.save_checkpoint(run_dir, step, backend, {"sampler": sampler.state(), "history": log.history})
                pm.hook.skyrl_on_checkpoint(step=step, path=path)
        hf_dir = None
        if options.export_hf:
            hf_dir = os.path.join(run_dir, HF_DIR)
            backend.save_hf(hf_dir)
        if tc.plot:
            plot_losses(log.history, os.path.join(run_dir, PLOT_FILE))
        pm.hook.skyrl_on_run_end(metrics=dict(log.history[-1]) if log.history else {}, run_dir=run_dir)
        return SFTResult(run_dir=run_dir, history=log.history, hf_dir=hf_dir)


def plot_losses(history: list[dict[str, Any]], path: str) -> str | None:
    """Train loss per step and eval loss at each evaluation, as a PNG; None if there is nothing to plot."""
    train = [(r["step"], r["loss"]) for r in history if r.get("loss") is not None]
    evals = [(r["step"], r["eval/loss"]) for r in history if r.get("eval/loss") is not None]
    if not train and not evals:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4), dpi=120)
    if train:
        ax.plot(*zip(*train), color="tab:blue", alpha=0.8, label="train loss (NLL per token)")
    if evals:
        ax.plot(*zip(*evals), "o-", color="tab:red", label="eval loss")
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.grid(alpha=0.3)
    ax.legend(loc="upper right")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path
