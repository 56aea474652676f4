"""Training runs from a config dict, for tests: write it as YAML, run ``skyrl train``'s loop on it,
return the metrics records."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import yaml


def train_config_dict(config: dict[str, Any], directory: Path, *, plugin_manager: Any = None) -> list[dict[str, Any]]:
    """Write ``config`` to ``directory/config.yaml``, train it, and return its ``metrics.jsonl``
    records (the config's ``trainer.output_dir`` says where the run writes)."""
    from skyrl_core.config.loader import load_config
    from skyrl_core.trainer.rl import train

    directory.mkdir(parents=True, exist_ok=True)
    path = directory / "config.yaml"
    path.write_text(yaml.safe_dump(config))
    result = train(load_config(str(path), [], plugin_manager=plugin_manager), plugin_manager=plugin_manager)
    return [json.loads(line) for line in (Path(result.run_dir) / "metrics.jsonl").read_text().splitlines()]
