"""The server's SQLite state without a server."""

import datetime as dt

from skyrl_tinker.store import DONE, FAILED, PENDING, FutureRow, InstanceRow, ModelRow, Store, done, failed


def test_store_writes_a_finished_batch_in_one_call_and_touches_its_model(tmp_path):
    url = f"sqlite:///{tmp_path / 's.db'}"
    store = Store(url)
    store.add(InstanceRow(id="proc1"))
    old = dt.datetime(2020, 1, 1, tzinfo=dt.timezone.utc)
    for model in ("m", "n"):
        store.add(ModelRow(id=model, owner="o", session_id="s", base_model="b", lora_rank=8, lora={}, server_instance="i", last_request=old))
    pending = {n: FutureRow(id=n, owner="o", model_id="m" if n == "a" else None, kind="sample", status=PENDING, created=old) for n in "abc"}
    store.finish([(pending["a"], done(proto=b"\x01\x02", seconds=0.5)), (pending["b"], failed("bad prompt", "user"))])
    assert pending["a"].status == PENDING  # the in-memory pending row is not the written one
    reopened = Store(url)
    rows = {r.id: r for r in reopened.rows(FutureRow)}
    assert set(rows) == {"a", "b"}  # "c" never finished: not written
    assert (rows["a"].status, rows["a"].result_proto, rows["a"].result_json, rows["a"].seconds) == (DONE, b"\x01\x02", None, 0.5)
    assert (rows["b"].status, rows["b"].error, rows["b"].category) == (FAILED, "bad prompt", "user")
    assert rows["a"].finished is not None and rows["b"].finished is not None
    assert reopened.get(ModelRow, "m").last_request.replace(tzinfo=dt.timezone.utc) == rows["a"].finished.replace(tzinfo=dt.timezone.utc)
    assert reopened.get(ModelRow, "n").last_request.replace(tzinfo=dt.timezone.utc) == old  # no future of its finished
    assert reopened.is_recorded_instance("proc1") and not reopened.is_recorded_instance("proc2")


def _write(directory, text: str) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "adapter.safetensors").write_text(text)


def test_a_starting_server_puts_back_a_checkpoint_an_interrupted_overwrite_moved_aside(tiny_model, tmp_path):
    from skyrl_core.directories import REPLACED
    from skyrl_tinker.service import TinkerService
    from skyrl_tinker.store import CheckpointRow, Store

    db = f"sqlite:///{tmp_path / 'db.sqlite'}"
    directory = tmp_path / "ckpt" / "anonymous" / "m" / "weights" / "kept"
    _write(tmp_path / "ckpt" / "anonymous" / "m" / "weights" / f"kept{REPLACED}", "old")
    Store(db).put([CheckpointRow(tinker_path="tinker://m/weights/kept", owner="anonymous", model_id="m", kind="training",
                                 checkpoint_id="weights/kept", directory=str(directory), size_bytes=3)])
    service = TinkerService(tiny_model, db_url=db, checkpoint_dir=str(tmp_path / "ckpt"))
    try:
        assert (directory / "adapter.safetensors").read_text() == "old"
    finally:
        service.close()


def test_rows_read_by_key_come_from_memory_and_stay_the_databases(tmp_path):
    """Futures, sampling sessions and checkpoints are read by key without a query once written or
    read; every write through the store keeps that copy the database's (a fresh store, which
    reads the file, agrees); a deleted or replaced one is never served stale."""
    from sqlalchemy import event

    from skyrl_tinker.store import CheckpointRow, SamplingSessionRow

    url = f"sqlite:///{tmp_path / 's.db'}"
    store = Store(url)
    queries: list[str] = []
    event.listen(store.engine, "before_cursor_execute", lambda conn, cursor, statement, *rest: queries.append(statement))

    def checkpoint(size: int) -> CheckpointRow:
        return CheckpointRow(tinker_path="tinker://m/weights/a", owner="o", model_id="m", kind="training",
                             checkpoint_id="weights/a", directory="/d", size_bytes=size, created=dt.datetime(2021, 1, 1))

    old = dt.datetime(2020, 1, 1, tzinfo=dt.timezone.utc)
    store.add(SamplingSessionRow(id="s1", owner="o", session_id="x", base_model="b", model_path=None))
    store.put([checkpoint(3)])
    store.finish([(FutureRow(id="f", owner="o", model_id=None, kind="sample", status=PENDING, created=old), done(proto=b"\x07", seconds=1.0))])
    queries.clear()
    assert store.get(SamplingSessionRow, "s1").session_id == "x"
    assert store.get(CheckpointRow, "tinker://m/weights/a").size_bytes == 3
    future = store.get(FutureRow, "f")
    assert (future.status, future.result_proto, future.owner, future.finished is not None) == (DONE, b"\x07", "o", True)
    assert queries == []  # all from memory
    assert store.get(ModelRow, "nobody") is None and len(queries) == 1  # (other tables are read from the file)

    store.put([checkpoint(5)])  # replaced
    assert store.get(CheckpointRow, "tinker://m/weights/a").size_bytes == 5
    fresh = Store(url)
    assert fresh.get(CheckpointRow, "tinker://m/weights/a").size_bytes == 5
    assert fresh.get(FutureRow, "f").result_proto == b"\x07" and fresh.get(SamplingSessionRow, "s1").owner == "o"
    store.delete(CheckpointRow, "tinker://m/weights/a")
    assert store.get(CheckpointRow, "tinker://m/weights/a") is None
    assert Store(url).get(CheckpointRow, "tinker://m/weights/a") is None
    store.update(SamplingSessionRow, "s1", model_path="tinker://m/sampler_weights/b")
    assert store.get(SamplingSessionRow, "s1").model_path == "tinker://m/sampler_weights/b"


def test_the_row_cache_drops_the_least_recently_used_beyond_its_rows_and_result_bytes():
    from skyrl_tinker.store import RowCache

    def future(name: str, size: int) -> FutureRow:
        return FutureRow(id=name, owner="o", kind="sample", status=DONE, result_proto=b"x" * size)

    cache = RowCache(max_rows=3, max_bytes=100)
    for name in "abc":
        cache.put(future(name, 10))
    assert cache.get(FutureRow, "a") is not None  # a is now the most recent
    cache.put(future("d", 10))
    assert [n for n in "abcd" if cache.get(FutureRow, n) is not None] == ["a", "c", "d"]  # b was the least recent
    cache.put(future("e", 85))  # 10 + 10 + 10 + 85 bytes > 100: the oldest (a, then c) go until it fits
    assert [n for n in "acde" if cache.get(FutureRow, n) is not None] == ["d", "e"]
    cache.put(future("huge", 101))  # larger than the whole budget: not kept, nothing else dropped for it
    assert cache.get(FutureRow, "huge") is None and cache.get(FutureRow, "e") is not None
    cache.put(future("e", 5))  # replacing a row counts its new size only
    assert cache._bytes == 10 + 5
    cache.drop(FutureRow, "e")
    assert cache.get(FutureRow, "e") is None and cache._bytes == 10


def test_a_row_deleted_while_it_is_being_read_is_not_left_in_memory(tmp_path):
    """A read that misses memory and a delete racing it: the read caches its row under the writers'
    lock, so the delete (which drops the copy) runs after it, not between the read and the caching."""
    import threading

    from skyrl_tinker.store import CheckpointRow

    store = Store(f"sqlite:///{tmp_path / 's.db'}")
    path = "tinker://m/weights/a"
    store.put([CheckpointRow(tinker_path=path, owner="o", model_id="m", kind="training", checkpoint_id="weights/a",
                             directory="/d", size_bytes=1, created=dt.datetime(2021, 1, 1))])
    store._cache.drop(CheckpointRow, path)  # (as after a restart: not in memory yet)
    deleter = threading.Thread(target=store.delete, args=(CheckpointRow, path))
    real_session = store.session

    class RacingSession:
        def __init__(self) -> None:
            self.inner = real_session()

        def __enter__(self):
            self.inner.__enter__()
            return self

        def __exit__(self, *exc):
            return self.inner.__exit__(*exc)

        def get(self, cls, key):
            row = self.inner.get(cls, key)
            store.session = real_session  # (only the first read races)
            deleter.start()
            deleter.join(0.5)  # the delete gets as far as it can while this read is unfinished
            return row

    store.session = RacingSession
    assert store.get(CheckpointRow, path) is not None  # read before the delete committed
    deleter.join(10)
    assert store.get(CheckpointRow, path) is None  # not served from a stale copy
