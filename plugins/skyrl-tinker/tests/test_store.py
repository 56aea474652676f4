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
