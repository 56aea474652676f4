"""The server's durable state in SQLite (SQLAlchemy): sessions, models (training runs), futures,
checkpoints and sampling sessions, each owned by the hash of the API key that made it.

A future is written once, when its work finishes, with its result in one transaction (a sampling
batch's futures together), so a restarted server answers for every finished request. Queued work
is held in memory only (no fsync per request): each future id starts with the id of the server
process that issued it, and every process start is recorded first, so a request id of an earlier
process that has no row is work that process never finished, reported failed, never lost.
"""

from __future__ import annotations

import collections
import datetime as dt
import json
import threading
from typing import Any, Sequence

from sqlalchemy import JSON, DateTime, Float, Integer, LargeBinary, String, Text, create_engine, event, insert, select, update
from sqlalchemy.orm import DeclarativeBase, Mapped, Session, mapped_column

PENDING, DONE, FAILED = "pending", "done", "failed"


def now() -> dt.datetime:
    return dt.datetime.now(dt.timezone.utc)


class Base(DeclarativeBase):
    pass


class SessionRow(Base):
    __tablename__ = "sessions"
    id: Mapped[str] = mapped_column(String, primary_key=True)
    owner: Mapped[str] = mapped_column(String, index=True)
    tags: Mapped[Any] = mapped_column(JSON, default=list)
    user_metadata: Mapped[Any] = mapped_column(JSON, nullable=True)
    sdk_version: Mapped[str] = mapped_column(String, default="")
    created: Mapped[dt.datetime] = mapped_column(DateTime(timezone=True), default=now)
    last_heartbeat: Mapped[dt.datetime] = mapped_column(DateTime(timezone=True), default=now)
    heartbeats: Mapped[int] = mapped_column(Integer, default=0)


class ModelRow(Base):
    __tablename__ = "models"
    id: Mapped[str] = mapped_column(String, primary_key=True)
    owner: Mapped[str] = mapped_column(String, index=True)
    session_id: Mapped[str] = mapped_column(String, index=True)
    base_model: Mapped[str] = mapped_column(String)
    lora_rank: Mapped[int] = mapped_column(Integer)
    lora: Mapped[Any] = mapped_column(JSON)  # rank, alpha, groups, seed
    user_metadata: Mapped[Any] = mapped_column(JSON, nullable=True)
    created: Mapped[dt.datetime] = mapped_column(DateTime(timezone=True), default=now)
    last_request: Mapped[dt.datetime] = mapped_column(DateTime(timezone=True), default=now)
    # The process whose memory holds the adapter: a restarted server has lost it.
    server_instance: Mapped[str] = mapped_column(String)


class FutureRow(Base):
    __tablename__ = "futures"
    id: Mapped[str] = mapped_column(String, primary_key=True)
    owner: Mapped[str] = mapped_column(String, index=True)
    model_id: Mapped[str | None] = mapped_column(String, nullable=True, index=True)
    kind: Mapped[str] = mapped_column(String)
    sampling_session: Mapped[str | None] = mapped_column(String, nullable=True, index=True)
    status: Mapped[str] = mapped_column(String, default=PENDING)
    result_json: Mapped[str | None] = mapped_column(Text, nullable=True)
    result_proto: Mapped[bytes | None] = mapped_column(LargeBinary, nullable=True)
    error: Mapped[str | None] = mapped_column(Text, nullable=True)
    category: Mapped[str | None] = mapped_column(String, nullable=True)
    created: Mapped[dt.datetime] = mapped_column(DateTime(timezone=True), default=now)
    finished: Mapped[dt.datetime | None] = mapped_column(DateTime(timezone=True), nullable=True)
    seconds: Mapped[float | None] = mapped_column(Float, nullable=True)


class CheckpointRow(Base):
    __tablename__ = "checkpoints"
    tinker_path: Mapped[str] = mapped_column(String, primary_key=True)
    owner: Mapped[str] = mapped_column(String, index=True)
    model_id: Mapped[str] = mapped_column(String, index=True)
    kind: Mapped[str] = mapped_column(String)  # "training" | "sampler"
    checkpoint_id: Mapped[str] = mapped_column(String)  # "weights/<name>" | "sampler_weights/<name>"
    directory: Mapped[str] = mapped_column(String)
    size_bytes: Mapped[int] = mapped_column(Integer, default=0)
    user_metadata: Mapped[Any] = mapped_column(JSON, nullable=True)
    created: Mapped[dt.datetime] = mapped_column(DateTime(timezone=True), default=now)


class InstanceRow(Base):
    """One server process start: the prefix of every future id it issues."""

    __tablename__ = "server_instances"
    id: Mapped[str] = mapped_column(String, primary_key=True)
    started: Mapped[dt.datetime] = mapped_column(DateTime(timezone=True), default=now)


class SamplingSessionRow(Base):
    __tablename__ = "sampling_sessions"
    id: Mapped[str] = mapped_column(String, primary_key=True)
    owner: Mapped[str] = mapped_column(String, index=True)
    session_id: Mapped[str] = mapped_column(String)
    base_model: Mapped[str] = mapped_column(String)
    model_path: Mapped[str | None] = mapped_column(String, nullable=True)
    created: Mapped[dt.datetime] = mapped_column(DateTime(timezone=True), default=now)


_PENDING_COLUMNS = ("id", "owner", "model_id", "kind", "sampling_session", "created")  # a pending future's own


class RowCache:
    """Rows by class and primary key, the least recently used dropped beyond ``max_rows`` rows or
    ``max_bytes`` of futures' results. Thread-safe."""

    def __init__(self, max_rows: int = 4096, max_bytes: int = 64 * 1024 * 1024) -> None:
        self.max_rows, self.max_bytes = max_rows, max_bytes
        self._rows: collections.OrderedDict[tuple[type, str], tuple[Any, int]] = collections.OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()

    def get(self, cls: type, key: str) -> Any:
        with self._lock:
            entry = self._rows.get((cls, key))
            if entry is None:
                return None
            self._rows.move_to_end((cls, key))
            return entry[0]

    def put(self, row: Any) -> None:
        size = len(getattr(row, "result_proto", None) or getattr(row, "result_json", None) or b"")
        with self._lock:
            self._drop(type(row), row_key(row))
            if size > self.max_bytes:
                return
            self._rows[(type(row), row_key(row))] = (row, size)
            self._bytes += size
            while len(self._rows) > self.max_rows or self._bytes > self.max_bytes:
                _, (_, dropped) = self._rows.popitem(last=False)
                self._bytes -= dropped

    def drop(self, cls: type, key: str) -> None:
        with self._lock:
            self._drop(cls, key)

    def _drop(self, cls: type, key: str) -> None:
        entry = self._rows.pop((cls, key), None)
        if entry is not None:
            self._bytes -= entry[1]


def row_key(row: Any) -> str:
    return row.tinker_path if isinstance(row, CheckpointRow) else row.id


class Store:
    """Thin transactional helpers over the tables (thread-safe: one session per call).

    Reads by key of the rows the hot paths look up (futures, sampling sessions, checkpoints) come
    from memory once written or read: every write goes through these methods, which keep that copy
    the database's (one server process owns its database). Each request of an RL step looked one or
    two up, and an ORM read holds the GIL for about half a millisecond on the event loop's thread,
    which the worker and sampling threads wait for."""

    CACHED = (FutureRow, SamplingSessionRow, CheckpointRow)

    def __init__(self, url: str) -> None:
        self.engine = create_engine(url, connect_args={"check_same_thread": False})

        @event.listens_for(self.engine, "connect")
        def _pragmas(dbapi_connection: Any, _: Any) -> None:
            cursor = dbapi_connection.cursor()
            cursor.execute("PRAGMA journal_mode=WAL")  # readers do not wait for the writer
            cursor.execute("PRAGMA synchronous=FULL")  # a finished future survives a power cut
            cursor.close()

        Base.metadata.create_all(self.engine)
        self._lock = threading.Lock()
        self._cache = RowCache()

    def session(self) -> Session:
        return Session(self.engine, expire_on_commit=False)

    def add(self, row: Base) -> None:
        with self._lock, self.session() as s:
            s.add(row)
            s.commit()
            self._cached(row)

    def get(self, cls: type, key: str) -> Any:
        """The row of that primary key (None: none). Do not change it: it may be the cached copy."""
        if cls not in self.CACHED:
            with self.session() as s:
                return s.get(cls, key)
        row = self._cache.get(cls, key)
        if row is None:
            # (read and cached under the writers' lock: a write between the two would otherwise
            # leave the older row cached over the newer one, or a deleted one cached)
            with self._lock, self.session() as s:
                row = s.get(cls, key)
                if row is not None:
                    self._cache.put(row)
        return row

    def _cached(self, row: Any) -> None:
        if isinstance(row, self.CACHED):
            self._cache.put(row)

    def delete(self, cls: type, key: str) -> None:
        with self._lock, self.session() as s:
            row = s.get(cls, key)
            if row is not None:
                s.delete(row)
            s.commit()
            self._cache.drop(cls, key)

    def rows(self, cls: type, **where: Any) -> list[Any]:
        with self.session() as s:
            statement = select(cls)
            for column, value in where.items():
                statement = statement.where(getattr(cls, column) == value)
            return list(s.scalars(statement.order_by(cls.created)))

    def update(self, cls: type, key: str, **values: Any) -> None:
        with self._lock, self.session() as s:
            row = s.get(cls, key)
            if row is not None:
                for column, value in values.items():
                    setattr(row, column, value)
                s.commit()
            self._cache.drop(cls, key)

    def count(self, cls: type) -> int:
        with self.session() as s:
            return len(list(s.scalars(select(cls.id if hasattr(cls, "id") else cls.tinker_path))))

    def put(self, rows: list[Base]) -> None:
        """Insert or replace ``rows`` (by primary key) in one transaction."""
        with self._lock, self.session() as s:
            merged = [s.merge(row) for row in rows]
            s.commit()
            for row in merged:
                self._cached(row)

    def finish(self, outcomes: list[tuple[FutureRow, dict[str, Any]]], rows: Sequence[Base] = ()) -> None:
        """Write finished futures (each a pending row, not in the database, and the columns
        ``done`` or ``failed`` gives) and the ``rows`` their work made (inserted or replaced by
        primary key) in ONE transaction, one fsync for a whole sampling batch, and touch the model
        each belongs to. The pending rows are left as they are (still pending)."""
        # (Statements, not ORM objects: a unit of work per future and a SELECT per model were half
        # of this call's time, which every request's result waits for.)
        with self._lock, self.session() as s:
            merged = [s.merge(row) for row in rows]
            stamp = now()
            finished = [{**{c: getattr(pending, c) for c in _PENDING_COLUMNS}, **values, "finished": stamp} for pending, values in outcomes]
            if finished:
                s.execute(insert(FutureRow), finished)
            models = {pending.model_id for pending, _ in outcomes if pending.model_id}
            if models:
                s.execute(update(ModelRow).where(ModelRow.id.in_(models)).values(last_request=stamp))
            s.commit()
            for row in merged:
                self._cached(row)
            for columns in finished:
                self._cache.put(FutureRow(**columns))

    def is_recorded_instance(self, instance_id: str) -> bool:
        return self.get(InstanceRow, instance_id) is not None


def done(*, result: Any = None, proto: bytes | None = None, seconds: float = 0.0) -> dict[str, Any]:
    """A finished future's columns: its result (JSON or protobuf bytes) and its run time."""
    return {"status": DONE, "result_json": None if proto is not None else json.dumps(result), "result_proto": proto,
            "seconds": seconds}


def failed(error: str, category: str) -> dict[str, Any]:
    return {"status": FAILED, "error": error, "category": category}

