"""``trainer.loggers: [wandb]``: a Weights & Biases run under ``<run_dir>/wandb``.

Offline unless ``WANDB_MODE`` says otherwise: the run is written to local files, no network is
touched, and ``wandb sync <run_dir>/wandb/offline-run-*`` uploads it later. ``WANDB_PROJECT``
names the project (default ``skyrl``); the run is named after the run directory and carries the
resolved config.
"""

from __future__ import annotations

import os
from typing import Any

from skyrl_core.plugins.records import LoggerSpec
from skyrl_core.trainer.loggers import LoggerPlugin


class WandbSink:
    def __init__(self, run_dir: str, config: Any) -> None:
        import wandb

        from skyrl_core.config.loader import unstructure

        self.run = wandb.init(
            mode=os.environ.get("WANDB_MODE", "offline"),
            dir=run_dir,
            project=os.environ.get("WANDB_PROJECT", "skyrl"),
            name=os.path.basename(os.path.normpath(run_dir)),
            config=unstructure(config),
            reinit="create_new",  # several runs in one process (tests, notebooks) stay separate
            settings=wandb.Settings(console="off", silent=True),
        )

    def log(self, step: int, metrics: dict[str, float]) -> None:
        self.run.log(metrics, step=step)

    def close(self) -> None:
        self.run.finish()


plugin = LoggerPlugin(LoggerSpec(name="wandb", factory="skyrl_loggers.wandb:WandbSink",
                                 description="Weights & Biases run in <run_dir>/wandb (offline by default)"))
