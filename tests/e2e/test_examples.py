"""Every example config validates, and the quickstart's data files are well-formed."""

from __future__ import annotations

from pathlib import Path

import pytest

from skyrl_core.config.loader import load_config
from skyrl_core.data import load_dataset

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = sorted((ROOT / "examples").glob("*.yaml"))


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_example_config_validates(path: Path, monkeypatch) -> None:
    monkeypatch.chdir(ROOT)  # data paths in examples are relative to the repository root
    cfg = load_config(str(path))
    for dataset in (cfg.data.train, cfg.data.eval):
        if dataset:
            assert load_dataset(dataset, default_env_class=cfg.environment.name)


def test_quickstart_train_and_eval_are_disjoint() -> None:
    train = load_dataset(ROOT / "examples/data/arithmetic/train.jsonl")
    held_out = load_dataset(ROOT / "examples/data/arithmetic/eval.jsonl")
    assert len(train) == 1000 and len(held_out) == 100
    question = lambda row: row["prompt"][-1]["content"]  # noqa: E731
    assert not {question(r) for r in train} & {question(r) for r in held_out}
    assert all(r["env_class"] == "arithmetic" for r in train + held_out)
