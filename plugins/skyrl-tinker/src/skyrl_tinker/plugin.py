"""skyrl-tinker's hook implementations. Light: importing this module imports no torch."""

from __future__ import annotations

from skyrl_core.plugins import hookimpl


@hookimpl
def skyrl_add_cli_commands(cli):
    from skyrl_tinker.cli import tinker_group

    cli.add_command(tinker_group)
