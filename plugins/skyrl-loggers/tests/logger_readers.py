"""Read each logger's output back with the library's own reader: ``{step: {key: value}}``."""

from __future__ import annotations

import glob
import json
import os
import struct
from typing import Any

Series = dict[int, dict[str, float]]


def tensorboard_series(run_dir: str) -> Series:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(os.path.join(run_dir, "tensorboard"), size_guidance={"scalars": 0})
    acc.Reload()
    out: Series = {}
    for tag in acc.Tags()["scalars"]:
        for event in acc.Scalars(tag):
            assert tag not in out.get(event.step, {}), f"{tag} logged twice at step {event.step}"
            out.setdefault(event.step, {})[tag] = event.value
    return out


def wandb_series(run_dir: str) -> Series:
    """History rows of the offline run: its ``.wandb`` file is a LevelDB-style log of wandb's own
    ``Record`` protobufs (wandb ships no Python reader for it any more), parsed with wandb's proto."""
    from wandb.proto import wandb_internal_pb2

    (path,) = glob.glob(os.path.join(run_dir, "wandb", "offline-run-*", "run-*.wandb"))
    data = open(path, "rb").read()
    assert data[:4] == b":W&B", data[:7]
    block, pos, pending, out = 32768, 7, b"", {}
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a header is padding
            pos += block - pos % block
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if length == 0 and kind == 0:
            break
        pending += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # FULL or LAST fragment
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            pending = b""
            if record.WhichOneof("record_type") == "history":
                row = {".".join(item.nested_key) or item.key: json.loads(item.value_json) for item in record.history.item}
                step = record.history.step.num
                values = {k: v for k, v in row.items() if not k.startswith("_")}
                assert not set(values) & set(out.get(step, {})), f"step {step} logged twice"
                out.setdefault(step, {}).update(values)
    return out


def mlflow_series(run_dir: str) -> tuple[Series, Any]:
    """The metrics of the only run in ``<run_dir>/mlruns`` and that run."""
    from mlflow.tracking import MlflowClient

    os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
    client = MlflowClient(tracking_uri="file:" + os.path.join(run_dir, "mlruns"))
    (experiment,) = [e for e in client.search_experiments() if e.name == "skyrl"]
    (run,) = client.search_runs([experiment.experiment_id])
    out: Series = {}
    for key in run.data.metrics:
        for metric in client.get_metric_history(run.info.run_id, key):
            out.setdefault(metric.step, {})[key] = metric.value
    return out, run
