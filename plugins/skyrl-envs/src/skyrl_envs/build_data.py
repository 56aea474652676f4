"""Rebuild the data files shipped in ``skyrl_envs/data/``: ``python -m skyrl_envs.build_data``.

Every file is deterministic (a test rebuilds them into a temporary directory and compares).
"""

from __future__ import annotations

from pathlib import Path

from skyrl_core.data import write_jsonl
from skyrl_envs.multi_tool_env import multi_tool_rows
from skyrl_envs.search_env import search_rows
from skyrl_envs.sql_shop import build_shop_database, shop_rows

DATA_DIR = Path(__file__).with_name("data")


def build_all(data_dir: Path = DATA_DIR) -> list[Path]:
    """Write the shop database and every shipped dataset under ``data_dir``; return the paths."""
    database = build_shop_database(data_dir / "sql" / "shop.sqlite")
    return [
        database,
        write_jsonl(shop_rows(database), data_dir / "sql" / "shop.jsonl"),
        write_jsonl(search_rows(), data_dir / "search" / "questions.jsonl"),
        write_jsonl(multi_tool_rows(), data_dir / "multi_tool" / "questions.jsonl"),
    ]


if __name__ == "__main__":
    for path in build_all():
        print("wrote", path)
