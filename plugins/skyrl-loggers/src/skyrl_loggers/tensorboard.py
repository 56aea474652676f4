"""``trainer.loggers: [tensorboard]``: scalars in ``<run_dir>/tensorboard`` (one tag per metric key)."""

from __future__ import annotations

import os
from typing import Any

from skyrl_core.plugins.records import LoggerSpec
from skyrl_core.trainer.loggers import LoggerPlugin

LOG_SUBDIR = "tensorboard"


class TensorBoardSink:
    def __init__(self, run_dir: str, config: Any) -> None:
        from torch.utils.tensorboard import SummaryWriter  # needs the tensorboard package

        self.writer = SummaryWriter(log_dir=os.path.join(run_dir, LOG_SUBDIR))

    def log(self, step: int, metrics: dict[str, float]) -> None:
        for key, value in metrics.items():
            self.writer.add_scalar(key, value, global_step=step)

    def close(self) -> None:
        self.writer.close()


plugin = LoggerPlugin(LoggerSpec(name="tensorboard", factory="skyrl_loggers.tensorboard:TensorBoardSink",
                                 description="TensorBoard event files in <run_dir>/tensorboard"))
