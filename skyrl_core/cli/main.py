"""The ``skyrl`` command. Plugins add subcommands through ``skyrl_add_cli_commands``."""

from __future__ import annotations

import json
import sys
import warnings
from typing import Any

import click

from skyrl_core import __version__

EXIT_CONFIG_ERROR = 2


def _version_text() -> str:
    from skyrl_core.plugins.manager import get_plugin_manager

    infos = [i for i in get_plugin_manager().infos.values() if i.kind == "plugin"]
    pairs = " ".join(f"{i.distribution}-{i.version}" for i in sorted(infos, key=lambda i: i.distribution))
    return f"skyrl-core {__version__}\nplugins: {pairs or '(none)'}"


def _print_version(ctx: click.Context, _param: Any, value: bool) -> None:
    if value and not ctx.resilient_parsing:
        click.echo(_version_text())
        ctx.exit(0)


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--version", is_flag=True, expose_value=False, is_eager=True, callback=_print_version,
              help="Show the core version and installed plugins.")
def cli() -> None:
    """skyrl: reinforcement learning for LLMs, a thin core plus plugins."""


@cli.group()
def plugins() -> None:
    """Inspect installed plugins."""


@plugins.command("list")
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead of a table.")
def plugins_list(as_json: bool) -> None:
    """Every plugin: name, version, kind, what it provides, and whether it loads."""
    from skyrl_core.plugins.manager import get_plugin_manager

    rows = get_plugin_manager().listing()
    if as_json:
        click.echo(json.dumps([r.as_dict() for r in rows], indent=2))
        return
    import shutil

    from rich.console import Console
    from rich.table import Table

    console = Console(width=max(shutil.get_terminal_size((140, 24)).columns, 100))
    table = Table(title="skyrl plugins")
    for col in ("name", "version", "kind", "status"):
        table.add_column(col, no_wrap=True)
    table.add_column("provides", overflow="fold", ratio=1)
    for r in rows:
        status = "[green]ok[/]" if r.status == "ok" else f"[red]{r.status}[/]"
        if r.status == "ok" and r.missing_requirements:
            status = "[yellow]missing dependencies[/]"
        table.add_row(r.name, f"{r.distribution} {r.version}", r.kind, status, _group_provides(r.provides))
    console.print(table)
    from skyrl_core.plugins.installation import install_command

    for r in rows:
        if r.error:
            console.print(f"[red]{r.name}[/]: {r.error}", markup=True, highlight=False)
        elif r.missing_requirements:
            console.print(f"[yellow]{r.name}[/]: needs {', '.join(r.missing_requirements)}, not installed; its "
                          f"components cannot run until they are ({install_command(r.distribution)})",
                          markup=True, highlight=False)


def _group_provides(provides: list[str]) -> str:
    by_kind: dict[str, list[str]] = {}
    for item in provides:
        kind, _, name = item.partition(":")
        by_kind.setdefault(kind, []).append(name)
    return "\n".join(f"{kind}: {', '.join(sorted(names))}" for kind, names in sorted(by_kind.items())) or "-"


@cli.group()
def config() -> None:
    """Validate and inspect configs."""


@config.command("show")
@click.argument("config_path", metavar="CONFIG")
@click.argument("overrides", nargs=-1, metavar="[KEY=VALUE]...")
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead of YAML.")
@click.option("--skip-checks", is_flag=True,
              help="Only validate keys and values; skip the checks of this machine (datasets, model, output "
                   "directory, installed components) that `skyrl train` runs first.")
def config_show(config_path: str, overrides: tuple[str, ...], as_json: bool, skip_checks: bool) -> None:
    """Validate CONFIG (plus dotted overrides) as `skyrl train` would, and print the resolved config."""
    cfg = load_config_or_exit(config_path, _with_shorthands(overrides))
    if not skip_checks:
        check_run_inputs_or_exit(cfg, config_path)
    from skyrl_core.config.loader import unstructure

    data = unstructure(cfg)
    data.update(data.pop("plugins", {}))
    if as_json:
        click.echo(json.dumps(data, indent=2, sort_keys=True))
    else:
        import yaml

        click.echo(yaml.safe_dump(data, sort_keys=False), nl=False)


@config.command("import-upstream")
@click.argument("upstream_path", metavar="FILE.yaml")
@click.option("--output", "-o", default=None, metavar="OUT",
              help="Write the translated config to OUT (default: standard output).")
def config_import_upstream(upstream_path: str, output: str | None) -> None:
    """Translate an upstream SkyRL (skyrl-train) YAML config into this project's config. Every upstream
    key without an equivalent here is named on stderr and in comments at the top of the output. Exit 0 when
    the translation validates, 2 when FILE.yaml cannot be read or the translation does not validate."""
    from skyrl_core.config.errors import ConfigError
    from skyrl_core.config.loader import load_yaml, structure_config
    from skyrl_core.config.upstream import UpstreamConfigError, render, translate_upstream

    try:
        translated, notes = translate_upstream(load_yaml(upstream_path))
    except ConfigError as exc:
        click.echo(exc.render(), err=True)
        sys.exit(EXIT_CONFIG_ERROR)
    except UpstreamConfigError as exc:
        click.echo(f"cannot import {upstream_path}: {exc}", err=True)
        sys.exit(EXIT_CONFIG_ERROR)
    text = render(translated, notes, upstream_path)
    if output:
        with open(output, "w", encoding="utf-8") as f:
            f.write(text)
    else:
        click.echo(text, nl=False)
    for note in notes:
        click.echo(f"not carried over: {note}", err=True)
    try:
        structure_config(translated)
    except ConfigError as exc:
        exc.source = output or "the translated config"
        click.echo(exc.render(), err=True)
        sys.exit(EXIT_CONFIG_ERROR)


@cli.command()
@click.argument("config_path", metavar="CONFIG")
@click.argument("overrides", nargs=-1, metavar="[KEY=VALUE]...")
def train(config_path: str, overrides: tuple[str, ...]) -> None:
    """Run RL training from CONFIG (plus dotted overrides such as trainer.lr=1e-6 resume=DIR)."""
    cfg = load_config_or_exit(config_path, _with_shorthands(overrides))
    from skyrl_core.config.errors import ConfigError
    from skyrl_core.trainer.rl import train as run_training

    from skyrl_core.trainer.divergence import NonFiniteTrainingError

    try:
        run_training(cfg)
    except ConfigError as exc:  # found by the pre-flight checks of paths, before any work
        exc.source = config_path
        click.echo(exc.render(), err=True)
        sys.exit(EXIT_CONFIG_ERROR)
    except NonFiniteTrainingError as exc:  # the run diverged: one sentence, not a traceback
        click.echo(f"error: {exc}", err=True)
        sys.exit(1)


@cli.command()
@click.argument("config_path", metavar="CONFIG")
@click.argument("overrides", nargs=-1, metavar="[KEY=VALUE]...")
def sft(config_path: str, overrides: tuple[str, ...]) -> None:
    """Supervised fine-tuning on the chat datasets of CONFIG (data.train, data.eval; the sft: section;
    overrides such as trainer.steps=20 resume=DIR)."""
    cfg = load_config_or_exit(config_path, _with_shorthands(overrides))
    from skyrl_core.config.errors import ConfigError
    from skyrl_core.trainer.sft import sft as run_sft

    try:
        result = run_sft(cfg)
    except ConfigError as exc:
        exc.source = config_path
        click.echo(exc.render(), err=True)
        sys.exit(EXIT_CONFIG_ERROR)
    last = next((r for r in reversed(result.history) if "eval/loss" in r), None)
    first = next((r for r in result.history if "eval/loss" in r), None)
    if first is not None and last is not None:
        click.echo(f"eval loss: step {first['step']} {first['eval/loss']:.4f} -> step {last['step']} {last['eval/loss']:.4f}")
    if result.hf_dir:
        click.echo(f"Hugging Face model: {result.hf_dir}")


@cli.command("eval")
@click.argument("config_path", metavar="CONFIG")
@click.argument("overrides", nargs=-1, metavar="[checkpoint=DIR] [KEY=VALUE]...")
@click.option("--output", "-o", default=None, metavar="FILE",
              help="Where the JSON results go (default: <trainer.output_dir>/eval_<checkpoint or model>.json).")
def eval_command(config_path: str, overrides: tuple[str, ...], output: str | None) -> None:
    """Evaluate only: accuracy, pass@n and mean reward on data.eval, for the model of CONFIG or a
    training checkpoint (checkpoint=DIR: a checkpoint or a run directory, whose latest is taken)."""
    checkpoints = [o.partition("=")[2] for o in overrides if o.startswith("checkpoint=")]
    cfg = load_config_or_exit(config_path, [o for o in overrides if not o.startswith("checkpoint=")])
    from skyrl_core.config.errors import ConfigError
    from skyrl_core.trainer.evaluation_run import run_evaluation

    try:
        report = run_evaluation(cfg, checkpoint=checkpoints[-1] if checkpoints else None, output=output)
    except ConfigError as exc:
        exc.source = config_path
        click.echo(exc.render(), err=True)
        sys.exit(EXIT_CONFIG_ERROR)
    click.echo(report.summary())


def _with_shorthands(overrides: tuple[str, ...]) -> list[str]:
    """`resume=DIR` is shorthand for `trainer.resume=DIR` (in `train` and `config show` alike)."""
    return [f"trainer.{o}" if o.startswith("resume=") else o for o in overrides]


def check_run_inputs_or_exit(cfg: Any, path: str) -> None:
    """The pre-flight checks `skyrl train` runs before any work (datasets, model, resume, output
    directory, selected components); exit 2 with every problem."""
    from skyrl_core.config.errors import ConfigError
    from skyrl_core.trainer.preflight import check_run_inputs

    try:
        check_run_inputs(cfg)
    except ConfigError as exc:
        exc.source = path
        click.echo(exc.render(), err=True)
        sys.exit(EXIT_CONFIG_ERROR)


def load_config_or_exit(path: str, overrides: list[str]):
    from skyrl_core.config.errors import ConfigError
    from skyrl_core.config.loader import load_config

    try:
        return load_config(path, overrides)
    except ConfigError as exc:
        click.echo(exc.render(), err=True)
        sys.exit(EXIT_CONFIG_ERROR)


def build_cli() -> click.Group:
    """The CLI with plugin subcommands added (a broken plugin's commands are skipped, not fatal)."""
    from skyrl_core.plugins.manager import get_plugin_manager

    pm = get_plugin_manager()
    for impl in pm.hook.skyrl_add_cli_commands.get_hookimpls():
        try:
            impl.function(cli=cli)
        # The core's commands must keep working, whatever the plugin raises (sys.exit included).
        except BaseException as exc:  # noqa: BLE001
            from skyrl_core.plugins.manager import _describe

            info = pm.infos.get(impl.plugin_name)
            if info is not None and info.status == "ok":
                info.status, info.error = "failed", f"skyrl_add_cli_commands: {_describe(exc)}"
            click.echo(f"warning: plugin {impl.plugin_name!r} failed to add commands: {_describe(exc)}", err=True)
    return cli


def _show_plugin_warnings(message: Any, category: type, *args: Any, _default=warnings.showwarning, **kwargs: Any) -> None:
    from skyrl_core.plugins.manager import SkyrlPluginWarning

    if issubclass(category, SkyrlPluginWarning):
        click.echo(f"warning: {message}", err=True)
    else:
        _default(message, category, *args, **kwargs)


def main(argv: list[str] | None = None) -> None:
    warnings.showwarning = _show_plugin_warnings
    build_cli()(args=argv, prog_name="skyrl")


if __name__ == "__main__":
    main()
