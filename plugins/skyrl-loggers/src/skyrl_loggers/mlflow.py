"""``trainer.loggers: [mlflow]``: an MLflow run, by default in the file store ``<run_dir>/mlruns``.

The file store needs no server or database (MLflow 3 keeps it behind ``MLFLOW_ALLOW_FILE_STORE``, which
the logger sets for it). ``MLFLOW_TRACKING_URI`` points it elsewhere, ``MLFLOW_EXPERIMENT_NAME`` names the experiment
(default ``skyrl``). MLflow allows only letters, digits and ``_ - . / : space`` in metric names:
any other character becomes ``_`` (``eval/pass@4`` is logged as ``eval/pass_4``).
"""

from __future__ import annotations

import os
import re
import time
from typing import Any

from skyrl_core.plugins.records import LoggerSpec
from skyrl_core.trainer.loggers import LoggerPlugin

STORE_SUBDIR = "mlruns"
_NOT_ALLOWED = re.compile(r"[^\w.\-/: ]")


def mlflow_key(key: str) -> str:
    """``key`` as MLflow accepts it."""
    return _NOT_ALLOWED.sub("_", key)


class MlflowSink:
    def __init__(self, run_dir: str, config: Any) -> None:
        from mlflow.tracking import MlflowClient

        uri = os.environ.get("MLFLOW_TRACKING_URI")
        if not uri:
            uri = "file:" + os.path.join(os.path.abspath(run_dir), STORE_SUBDIR)
            # MLflow 3 refuses its file store unless asked: it needs no server and no database, and
            # every MLflow version reads it (`mlflow ui --backend-store-uri <run_dir>/mlruns`).
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        self.client = MlflowClient(tracking_uri=uri)
        name = os.environ.get("MLFLOW_EXPERIMENT_NAME", "skyrl")
        experiment = self.client.get_experiment_by_name(name)
        experiment_id = experiment.experiment_id if experiment else self.client.create_experiment(name)
        run_name = os.path.basename(os.path.normpath(run_dir))
        self.run_id = self.client.create_run(experiment_id, run_name=run_name).info.run_id

    def log(self, step: int, metrics: dict[str, float]) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        self.client.log_batch(self.run_id, metrics=[Metric(mlflow_key(k), v, now, step) for k, v in metrics.items()])

    def close(self) -> None:
        self.client.set_terminated(self.run_id)


plugin = LoggerPlugin(LoggerSpec(name="mlflow", factory="skyrl_loggers.mlflow:MlflowSink",
                                 description="MLflow run in the file store <run_dir>/mlruns"))
