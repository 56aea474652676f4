"""Run metrics: one JSON object per line in ``metrics.jsonl``, and the reward/eval plot.

Every record has ``step`` (0 for the evaluation before training). Keys under ``time/`` are wall
times in seconds: the only values that differ between two identical runs.
"""

from __future__ import annotations

import json
import math
import os
from typing import Any, Iterable

METRICS_FILE = "metrics.jsonl"
PLOT_FILE = "metrics.png"


def _jsonable(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None if math.isnan(value) else (1e308 if value > 0 else -1e308)
    return value


class MetricsLog:
    """Appends records to ``<run_dir>/metrics.jsonl`` and keeps them in ``history``.

    ``history`` travels in checkpoints; a resumed run rewrites the file from it, so the file
    holds exactly the steps up to the checkpoint followed by the resumed ones.
    """

    def __init__(self, run_dir: str, history: Iterable[dict[str, Any]] = ()) -> None:
        self.path = os.path.join(run_dir, METRICS_FILE)
        self.history: list[dict[str, Any]] = [dict(r) for r in history]
        with open(self.path, "w", encoding="utf-8") as f:
            for record in self.history:
                f.write(json.dumps(record, sort_keys=True) + "\n")

    def write(self, record: dict[str, Any]) -> None:
        record = {k: _jsonable(v) for k, v in record.items()}
        self.history.append(record)
        with open(self.path, "a", encoding="utf-8") as f:
            f.write(json.dumps(record, sort_keys=True) + "\n")

    def series(self, key: str) -> tuple[list[int], list[float]]:
        points = [(r["step"], r[key]) for r in self.history if r.get(key) is not None]
        return [p[0] for p in points], [p[1] for p in points]


def read_metrics(run_dir: str) -> list[dict[str, Any]]:
    """The records of ``<run_dir>/metrics.jsonl`` in order."""
    with open(os.path.join(run_dir, METRICS_FILE), encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def without_timings(record: dict[str, Any]) -> dict[str, Any]:
    """``record`` without its ``time/`` and throughput keys (what must match across identical runs)."""
    return {k: v for k, v in record.items() if not k.startswith(("time/", "throughput/"))}


def plot_metrics(log: MetricsLog, path: str) -> str | None:
    """Training reward (and accuracy) per step, with held-out accuracy, as a PNG; None if empty."""
    steps, rewards = log.series("reward/mean")
    eval_steps, eval_acc = log.series("eval/accuracy")
    if not steps and not eval_steps:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4), dpi=120)
    if steps:
        ax.plot(steps, rewards, color="tab:blue", alpha=0.8, label="train reward (mean)")
        acc_steps, acc = log.series("accuracy")
        if acc and acc != rewards:
            ax.plot(acc_steps, acc, color="tab:cyan", alpha=0.6, label="train accuracy")
    if eval_steps:
        ax.plot(eval_steps, eval_acc, "o-", color="tab:red", label="held-out accuracy")
        for x, y in zip(eval_steps, eval_acc):
            ax.annotate(f"{y:.2f}", (x, y), textcoords="offset points", xytext=(0, 6), ha="center", fontsize=8)
    ax.set_xlabel("step")
    ax.set_ylabel("reward / accuracy")
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path
