"""``sql``: text-to-SQL over a real SQLite database, multi-turn with an ``<sql>`` tool.

Each row names its database: ``db_path`` (a file), or ``db_id`` looked up in ``db_dir`` as
``<db_id>.sqlite``, ``<db_id>.db`` or ``<db_id>/<db_id>.sqlite`` (the Spider layout); the default
``db_dir`` holds the shipped ``shop`` database. ``reward_spec.ground_truth`` is the gold query.

Each turn the model either explores with ``<sql>query</sql>`` (it is shown the result or the
error as the next user message) or ends with ``<solution>query</solution>``: reward 1.0 when that
query's result equals the gold query's result as a multiset of rows (in order when
``order_matters``; floats compared to 6 decimals; column names ignored), else 0.0. A turn
with neither tag gets a reminder. After ``max_turns`` turns without a solution, reward 0.0.

The database is opened read-only three ways (``mode=ro`` URI, ``PRAGMA query_only``, and an
authorizer that allows only reading, and only the functions and pragmas of ``sql_allowlist``), so
no query can change it. Each statement runs under a time limit, while SQLite computes and while
rows are fetched; results are bounded before anything is formatted: at most 256 columns,
``MAX_VALUE_BYTES`` per value, ``max_result_rows`` rows and ``max_result_bytes`` bytes. Sorts and
temporary tables stay in memory (``temp_store = MEMORY``, no temporary files), under SQLite's hard
heap limit ``sqlite_heap_bytes`` (process-wide: it is only ever lowered).
"""

from __future__ import annotations

import sqlite3
import time
from collections import Counter
from pathlib import Path
from typing import Any

import attrs

from skyrl_core.tools import Tool, ToolBox, find_tag_calls
from skyrl_core.types import Message, StepResult
from skyrl_envs.base import EpisodeEnv, ground_truth, prompt_messages
from skyrl_envs.sql_allowlist import ReadOnlyAuthorizer

SHIPPED_DB_DIR = Path(__file__).with_name("data") / "sql"
MAX_VALUE_BYTES = 100_000  # longest string, blob or sort record a query may build (SQLITE_LIMIT_LENGTH)
MAX_COLUMNS = 256  # widest result (SQLITE_LIMIT_COLUMN)
_SHOWN_VALUE_CHARS = 200  # each value is cut to this before formatting


class QueryError(Exception):
    """A query failed: bad SQL, a refused action, the time limit, or too many rows."""


def _positive(instance: Any, attribute: attrs.Attribute, value: float) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
        raise ValueError(f"sql option {attribute.name} must be a positive number, got {value!r}")


@attrs.frozen(kw_only=True)
class SQLOptions:
    db_dir: str = attrs.field(default=str(SHIPPED_DB_DIR), metadata={"help": "directory of <db_id>.sqlite files"})
    max_turns: int = attrs.field(default=5, validator=_positive, metadata={"help": "turns before the episode ends"})
    timeout_seconds: float = attrs.field(default=1.0, validator=_positive,
                                         metadata={"help": "time limit of each statement"})
    max_rows_shown: int = attrs.field(default=20, validator=_positive, metadata={"help": "rows shown per <sql> result"})
    max_result_rows: int = attrs.field(default=10_000, validator=_positive,
                                       metadata={"help": "largest result a <solution> or gold query may have"})
    max_result_bytes: int = attrs.field(default=4_000_000, validator=_positive,
                                        metadata={"help": "largest result (bytes of its values) fetched from any query"})
    max_observation_chars: int = attrs.field(default=3000, validator=_positive,
                                             metadata={"help": "observations are cut to this length"})
    sqlite_heap_bytes: int = attrs.field(default=256 * 1024 * 1024, validator=_positive,
                                         metadata={"help": "SQLite's hard heap limit (process-wide, only lowered)"})
    order_matters: bool = attrs.field(default=False, metadata={"help": "compare results as ordered lists"})


class ReadOnlyConnection(sqlite3.Connection):
    """A connection that remembers its authorizer, so a refusal's error can say what was refused."""

    authorizer: ReadOnlyAuthorizer


def open_read_only(path: str | Path, *, heap_bytes: int = 256 * 1024 * 1024) -> ReadOnlyConnection:
    """A connection that can only read ``path``: ``mode=ro``, ``query_only``, a read-only authorizer."""
    path = Path(path).resolve()
    if not path.is_file():
        raise FileNotFoundError(f"no SQLite database at {path}")
    connection = sqlite3.connect(f"{path.as_uri()}?mode=ro", uri=True, isolation_level=None, check_same_thread=False,
                                 factory=ReadOnlyConnection)
    connection.execute("PRAGMA query_only = ON")
    connection.execute("PRAGMA temp_store = MEMORY")  # no temporary files: sorts spill into the bounded heap
    current = connection.execute("PRAGMA hard_heap_limit").fetchone()[0]
    if current == 0 or current > heap_bytes:
        connection.execute(f"PRAGMA hard_heap_limit = {int(heap_bytes)}")
    connection.setlimit(sqlite3.SQLITE_LIMIT_LENGTH, MAX_VALUE_BYTES)
    connection.setlimit(sqlite3.SQLITE_LIMIT_COLUMN, MAX_COLUMNS)
    connection.setlimit(sqlite3.SQLITE_LIMIT_ATTACHED, 0)
    connection.authorizer = ReadOnlyAuthorizer()
    connection.set_authorizer(connection.authorizer)
    return connection


def _value_bytes(value: Any) -> int:
    return len(value) if isinstance(value, (str, bytes)) else 8


def run_query(connection: sqlite3.Connection, sql: str, *, timeout_seconds: float, max_rows: int,
              max_bytes: int = 4_000_000) -> tuple[list[str], list[tuple], str]:
    """``(column names, rows, cut)`` of one statement: at most ``max_rows`` rows and ``max_bytes``
    bytes of values; ``cut`` is ``"rows"`` or ``"bytes"`` when more were left out, else ``""``.

    Raises ``QueryError`` for bad SQL, refused actions, several statements, or the time limit
    (checked while SQLite works and between fetched rows).
    """
    deadline = time.monotonic() + timeout_seconds
    connection.set_progress_handler(lambda: int(time.monotonic() > deadline), 1000)
    authorizer = getattr(connection, "authorizer", None)
    if authorizer is not None:
        authorizer.refusal = ""
    rows, size, cut = [], 0, ""
    try:
        cursor = connection.execute(sql)
        columns = [d[0] for d in cursor.description or ()]
        while True:
            if time.monotonic() > deadline:
                raise sqlite3.OperationalError("interrupted")
            row = cursor.fetchone()
            if row is None:
                break
            size += sum(_value_bytes(v) for v in row)
            if len(rows) == max_rows or (size > max_bytes and rows):  # the first row is bounded by the limits
                cut = "rows" if len(rows) == max_rows else "bytes"
                break
            rows.append(row)
        cursor.close()
    except sqlite3.OperationalError as error:
        if str(error) == "interrupted":
            raise QueryError(f"the query ran longer than {timeout_seconds:g} s and was stopped") from None
        if str(error).startswith("not authorized") and authorizer is not None and authorizer.refusal:
            raise QueryError(f"not authorized: {authorizer.refusal}") from None
        raise QueryError(str(error)) from None
    except MemoryError:  # SQLITE_NOMEM: the hard heap limit
        raise QueryError("the query needed more memory than allowed and was stopped") from None
    except (sqlite3.Error, sqlite3.Warning, ValueError, OverflowError) as error:
        raise QueryError(str(error)) from None
    finally:
        connection.set_progress_handler(None, 1000)
    return columns, rows, cut


def _comparable(value: Any) -> Any:
    if isinstance(value, float):
        value = round(value, 6)
        return int(value) if value.is_integer() else value
    return value


def results_equal(predicted: list[tuple], gold: list[tuple], *, order_matters: bool) -> bool:
    """Equal as multisets of rows (or lists when ``order_matters``), floats to 6 decimals."""
    left = [tuple(_comparable(v) for v in row) for row in predicted]
    right = [tuple(_comparable(v) for v in row) for row in gold]
    return left == right if order_matters else Counter(left) == Counter(right)


def _shown(value: Any) -> str:
    """One value as text, cut before it is converted (a blob's text form is 4x its size)."""
    if value is None:
        return "NULL"
    if isinstance(value, bytes):
        head = value[: _SHOWN_VALUE_CHARS // 2].hex()
        return f"x'{head}'" + (f"...({len(value)} bytes)" if len(value) > _SHOWN_VALUE_CHARS // 2 else "")
    text = value if isinstance(value, str) else str(value)
    return text if len(text) <= _SHOWN_VALUE_CHARS else text[:_SHOWN_VALUE_CHARS] + f"...({len(text)} chars)"


def format_result(columns: list[str], rows: list[tuple], cut: str | bool, limit_chars: int,
                  max_bytes: int = 0) -> str:
    lines = [" | ".join(columns)] + [" | ".join(_shown(v) for v in row) for row in rows]
    if cut == "bytes":
        note = f"({len(rows)} rows, result cut at {max_bytes} bytes)"
    else:
        note = f"({len(rows)} rows{', more not shown' if cut else ''})"
    text = "\n".join(lines)
    if len(text) > limit_chars:
        text = text[:limit_chars] + "\n...(cut)"
    return text + "\n" + note


class SQLEnv(EpisodeEnv):
    options_class = SQLOptions
    name = "sql"

    def __init__(self, **options: Any):
        super().__init__(**options)
        self._connection: sqlite3.Connection | None = None
        self._tools = ToolBox([Tool(name="sql", description="run one read-only SQLite query and see its result",
                                    run=self._explore)])

    def database_path(self, sample: dict[str, Any]) -> Path:
        """Where the row's database is (``db_path``, or ``db_id`` under ``db_dir``)."""
        if sample.get("db_path"):
            return Path(sample["db_path"])
        db_id = sample.get("db_id")
        if not db_id:
            raise ValueError("sql: the row needs a 'db_id' (or 'db_path') column")
        root = Path(self.options.db_dir)
        candidates = [root / f"{db_id}.sqlite", root / f"{db_id}.db", root / db_id / f"{db_id}.sqlite"]
        for candidate in candidates:
            if candidate.is_file():
                return candidate
        raise FileNotFoundError(f"sql: no database for db_id {db_id!r}; looked for {', '.join(map(str, candidates))}")

    def start(self, sample: dict[str, Any]) -> list[Message]:
        gold_sql = str(ground_truth(sample, self.name))
        messages = prompt_messages(sample, self.name)
        self._connection = open_read_only(self.database_path(sample), heap_bytes=self.options.sqlite_heap_bytes)
        try:
            # The gold query is trusted but may be heavier than the model's: it gets 5x the time.
            _, self._gold_rows, too_many = run_query(self._connection, gold_sql, max_rows=self.options.max_result_rows,
                                                     max_bytes=self.options.max_result_bytes,
                                                     timeout_seconds=self.options.timeout_seconds * 5)
        except QueryError as error:
            self.close()
            raise ValueError(f"sql: the gold query of this row fails: {error}: {gold_sql!r}") from None
        if too_many:
            self.close()
            raise ValueError(f"sql: the gold query returns more than {self.options.max_result_rows} rows or "
                             f"{self.options.max_result_bytes} bytes: {gold_sql!r}")
        return messages

    def judge(self, action_text: str) -> StepResult:
        solutions = find_tag_calls(action_text, ["solution"])
        if solutions:
            return self._grade(solutions[-1].argument)
        call = self._tools.first_call(action_text)
        if self.turn >= self.options.max_turns:
            return self.finish(0.0, reason="max_turns")
        if call is None:
            return self.observe("No <sql> query or <solution> found. Write <sql>...</sql> to run a query, "
                                "or <solution>...</solution> to answer.", reason="no_tool_call")
        return self.observe(self._tools.execute(call), reason="sql")

    def close(self) -> None:
        if self._connection is not None:
            self._connection.close()
            self._connection = None

    def _explore(self, sql: str) -> str:
        try:
            columns, rows, cut = run_query(self._connection, sql, timeout_seconds=self.options.timeout_seconds,
                                           max_rows=self.options.max_rows_shown, max_bytes=self.options.max_result_bytes)
        except QueryError as error:
            return f"Error: {error}"
        return format_result(columns, rows, cut, self.options.max_observation_chars, self.options.max_result_bytes)

    def _grade(self, sql: str) -> StepResult:
        try:
            _, rows, too_many = run_query(self._connection, sql, timeout_seconds=self.options.timeout_seconds,
                                          max_rows=self.options.max_result_rows, max_bytes=self.options.max_result_bytes)
        except QueryError as error:
            return self.finish(0.0, reason="solution_error", error=str(error))
        if too_many:
            return self.finish(0.0, reason="solution_too_large")
        correct = results_equal(rows, self._gold_rows, order_matters=self.options.order_matters)
        return self.finish(1.0 if correct else 0.0, reason="solution")
