"""Datasets: JSONL or parquet files of rows, one row per prompt.

A row has the columns upstream SkyRL datasets use, so those files load as they are:

- ``prompt``: the chat messages, a list of ``{"role": ..., "content": ...}``;
- ``env_class``: the registered environment that judges the row (may be left out when the
  caller gives ``default_env_class``);
- ``reward_spec``: what the environment checks against, usually ``{"ground_truth": ...}``
  (optional, ``{}`` when absent);
- ``extra_info``: free metadata (optional, ``{}`` when absent);
- any other column (``db_id``, ``data``, ...), kept as is: the whole row is what
  ``Environment.reset(sample)`` receives.

Parquet needs ``pyarrow``, imported only when a parquet file is read or written.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Iterable, Sequence

ROLES = ("system", "user", "assistant", "tool")
SUFFIXES = (".jsonl", ".json", ".parquet")


class DatasetError(ValueError):
    """A dataset file is missing, unreadable, or has a row that breaks the format."""


def load_dataset(path: str | Path, *, default_env_class: str | None = None) -> list[dict[str, Any]]:
    """The validated rows of one ``.jsonl``/``.json``/``.parquet`` file.

    ``.json`` holds a list of row objects. Missing ``reward_spec``/``extra_info`` become ``{}``;
    a missing ``env_class`` becomes ``default_env_class`` (an error when that is ``None``).
    Raises ``DatasetError`` naming the file and the row (0-based) that is wrong.
    """
    path = Path(path)
    if not path.is_file():
        raise DatasetError(f"dataset file {str(path)!r} does not exist")
    suffix = path.suffix.lower()
    if suffix == ".jsonl":
        rows = _read_jsonl(path)
    elif suffix == ".json":
        rows = _read_json(path)
    elif suffix == ".parquet":
        rows = _read_parquet(path)
    else:
        raise DatasetError(f"dataset file {str(path)!r} has suffix {suffix!r}; allowed: {', '.join(SUFFIXES)}")
    return [_validate_row(row, path, index, default_env_class) for index, row in enumerate(rows)]


def load_datasets(paths: Sequence[str | Path], *, default_env_class: str | None = None) -> list[dict[str, Any]]:
    """The rows of several files, concatenated in the order given."""
    rows: list[dict[str, Any]] = []
    for path in paths:
        rows.extend(load_dataset(path, default_env_class=default_env_class))
    return rows


def write_jsonl(rows: Iterable[dict[str, Any]], path: str | Path) -> Path:
    """Write rows as JSON lines (keys sorted, so equal rows give equal bytes)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", encoding="utf-8") as handle:
        for row in rows:
            handle.write(json.dumps(row, sort_keys=True, ensure_ascii=False) + "\n")
    return path


def write_parquet(rows: Iterable[dict[str, Any]], path: str | Path) -> Path:
    """Write rows as a parquet file (needs pyarrow)."""
    pa, pq = _pyarrow()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(list(rows)), path)
    return path


# --- reading -------------------------------------------------------------------------------------


def _read_jsonl(path: Path) -> list[Any]:
    rows = []
    with path.open(encoding="utf-8") as handle:
        for line_number, line in enumerate(handle, start=1):
            if not line.strip():
                continue
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as error:
                raise DatasetError(f"{path}: line {line_number} is not valid JSON: {error}") from None
    return rows


def _read_json(path: Path) -> list[Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as error:
        raise DatasetError(f"{path}: not valid JSON: {error}") from None
    if not isinstance(data, list):
        raise DatasetError(f"{path}: a .json dataset must hold a list of rows, got {type(data).__name__}")
    return data


def _read_parquet(path: Path) -> list[Any]:
    _, pq = _pyarrow()
    try:
        table = pq.read_table(path)
    except Exception as error:
        raise DatasetError(f"{path}: cannot read parquet: {error}") from None
    return table.to_pylist()


def _pyarrow():
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq
    except ImportError:
        raise DatasetError("parquet datasets need pyarrow: pip install pyarrow") from None
    return pa, pq


# --- validation ----------------------------------------------------------------------------------


def _validate_row(row: Any, path: Path, index: int, default_env_class: str | None) -> dict[str, Any]:
    where = f"{path}: row {index}"
    if not isinstance(row, dict):
        raise DatasetError(f"{where} must be an object with a 'prompt' column, got {type(row).__name__}")
    if "prompt" not in row:
        raise DatasetError(f"{where} has no 'prompt' column (columns: {', '.join(sorted(row)) or 'none'})")
    row = dict(row)
    row["prompt"] = _validate_messages(row["prompt"], where)
    env_class = row.get("env_class") or default_env_class
    if not env_class:
        raise DatasetError(f"{where} has no 'env_class' and no default environment was given")
    if not isinstance(env_class, str):
        raise DatasetError(f"{where}: 'env_class' must be a string, got {env_class!r}")
    row["env_class"] = env_class
    for column in ("reward_spec", "extra_info"):
        value = row.get(column)
        if value is None:
            row[column] = {}
        elif not isinstance(value, dict):
            raise DatasetError(f"{where}: {column!r} must be an object, got {type(value).__name__}")
    return row


def _validate_messages(prompt: Any, where: str) -> list[dict[str, Any]]:
    if hasattr(prompt, "tolist"):  # numpy arrays from pandas-written parquet
        prompt = prompt.tolist()
    if isinstance(prompt, str) or not isinstance(prompt, (list, tuple)) or not prompt:
        raise DatasetError(
            f"{where}: 'prompt' must be a non-empty list of {{'role', 'content'}} messages, got {prompt!r:.80}"
        )
    messages = []
    for number, message in enumerate(prompt):
        if not isinstance(message, dict) or not isinstance(message.get("content"), str):
            raise DatasetError(f"{where}: prompt message {number} must have a string 'content', got {message!r:.80}")
        if message.get("role") not in ROLES:
            raise DatasetError(
                f"{where}: prompt message {number} has role {message.get('role')!r}; allowed: {', '.join(ROLES)}"
            )
        messages.append({k: v for k, v in message.items() if v is not None})
    return messages


__all__ = ["DatasetError", "load_dataset", "load_datasets", "write_jsonl", "write_parquet"]
