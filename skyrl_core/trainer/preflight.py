"""Checks of everything a run reads from disk, done before any work starts.

The config loader checks keys, types and values; it does not look at the disk (``skyrl config
show`` must work on a config written for another machine). ``check_run_inputs`` is the second
half, run by ``skyrl train`` before it creates the run directory or loads a model: the datasets
parse, the model directory and the checkpoint to resume from exist, the output directory can be
made. Every problem is reported at once, as a ``ConfigError`` naming the key path and the value,
so a typo costs a second, not a model load.
"""

from __future__ import annotations

import os
from typing import Any

import attrs

from skyrl_core.config.errors import ConfigError, ConfigIssue
from skyrl_core.data import SUFFIXES, DatasetError, load_dataset


@attrs.frozen
class RunInputs:
    """What the checks read, so the run does not read it twice."""

    train_rows: list[dict[str, Any]]
    eval_rows: list[dict[str, Any]]
    resume_from: str | None  # the checkpoint directory ``trainer.resume`` resolves to


def check_run_inputs(cfg: Any, *, smollm2_dir: str | None = None) -> RunInputs:
    """The parsed datasets and resolved checkpoint of ``cfg``; raises ``ConfigError`` listing every
    problem. ``smollm2_dir`` is the demo model directory that is converted on first use (it need
    not exist yet)."""
    issues: list[ConfigIssue] = []
    env = cfg.environment.name
    train_rows: list[dict[str, Any]] = []
    eval_rows: list[dict[str, Any]] = []
    if cfg.data.train is None:
        issues.append(ConfigIssue("data.train", f"is not set: give a dataset of prompts ({', '.join(SUFFIXES)})"))
    else:
        train_rows = _dataset(issues, "data.train", cfg.data.train, env)
        if not train_rows and not any(i.path == "data.train" for i in issues):
            issues.append(ConfigIssue("data.train", f"{cfg.data.train!r} has no rows"))
    if cfg.data.eval is not None:
        eval_rows = _dataset(issues, "data.eval", cfg.data.eval, env)

    path = cfg.model.path
    if path is not None:
        full = os.path.abspath(os.path.expanduser(path))
        is_demo = smollm2_dir is not None and full == os.path.abspath(os.path.expanduser(smollm2_dir))
        if not is_demo and not os.path.isfile(os.path.join(full, "config.json")):
            what = "has no config.json" if os.path.isdir(full) else "does not exist"
            issues.append(ConfigIssue("model.path", f"{path!r} {what}: give a local Hugging Face model directory"))
    tokenizer = cfg.model.tokenizer
    if tokenizer is not None and not os.path.isdir(os.path.expanduser(tokenizer)):
        issues.append(ConfigIssue("model.tokenizer", f"{tokenizer!r} is not a directory"))

    resume_from = None
    if cfg.trainer.resume:
        from skyrl_core.trainer.checkpoint import resolve_checkpoint

        try:
            resume_from = resolve_checkpoint(cfg.trainer.resume)
        except FileNotFoundError as exc:
            issues.append(ConfigIssue("trainer.resume", str(exc).removeprefix("trainer.resume=")))

    out = os.path.abspath(os.path.expanduser(cfg.trainer.output_dir))
    existing = out
    while not os.path.exists(existing):
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing):
        issues.append(ConfigIssue("trainer.output_dir", f"{cfg.trainer.output_dir!r}: {existing!r} is a file"))
    elif not os.access(existing, os.W_OK):
        issues.append(ConfigIssue("trainer.output_dir", f"{cfg.trainer.output_dir!r}: {existing!r} is not writable"))

    if issues:
        raise ConfigError(issues)
    return RunInputs(train_rows=train_rows, eval_rows=eval_rows, resume_from=resume_from)


def _dataset(issues: list[ConfigIssue], key: str, path: str, env: str) -> list[dict[str, Any]]:
    try:
        return load_dataset(os.path.expanduser(path), default_env_class=env)
    except DatasetError as exc:
        issues.append(ConfigIssue(key, str(exc)))
        return []
