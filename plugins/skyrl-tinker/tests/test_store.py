"""The server's SQLite state without a server."""

import datetime as dt

import pytest

from skyrl_tinker.store import DONE, FAILED, PENDING, FutureRow, InstanceRow, ModelRow, Store, done, failed


def test_store_writes_a_finished_batch_in_one_call_and_touches_its_model(tmp_path):
    url = f"sqlite:///{tmp_path / 's.db'}"
    store = Store(url)
    store.add(InstanceRow(id="proc1"))
    old = dt.datetime(2020, 1, 1, tzinfo=dt.timezone.utc)
    store.add(ModelRow(id="m", owner="o", session_id="s", base_model="b", lora_rank=8, lora={}, server_instance="i", last_request=old))
    pending = {n: FutureRow(id=n, owner="o", model_id="m" if n == "a" else None, kind="sample", status=PENDING, created=old) for n in "abc"}
    store.finish([(pending["a"], done(proto=b"\x01\x02", seconds=0.5)), (pending["b"], failed("bad prompt", "user"))])
    assert pending["a"].status == PENDING  # the in-memory pending row is not the written one
    reopened = Store(url)
    rows = {r.id: r for r in reopened.rows(FutureRow)}
    assert set(rows) == {"a", "b"}  # "c" never finished: not written
    assert (rows["a"].status, rows["a"].result_proto, rows["a"].result_json, rows["a"].seconds) == (DONE, b"\x01\x02", None, 0.5)
    assert (rows["b"].status, rows["b"].error, rows["b"].category) == (FAILED, "bad prompt", "user")
    assert rows["a"].finished is not None and rows["b"].finished is not None
    assert reopened.get(ModelRow, "m").last_request.replace(tzinfo=dt.timezone.utc) > old
    assert reopened.is_recorded_instance("proc1") and not reopened.is_recorded_instance("proc2")


def _write(directory, text: str) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "adapter.safetensors").write_text(text)


def test_overwriting_a_checkpoint_keeps_one_whole_copy_on_disk_through_a_crash(tmp_path, monkeypatch):
    """``publish_directory`` moves the old checkpoint aside before the new one takes its place; a
    crash between the two renames (simulated: the second rename fails) leaves the old one aside,
    and ``recover_replaced`` (run at server start) puts it back bit for bit."""
    import os

    import skyrl_tinker.service as service_module
    from skyrl_tinker.service import PARTIAL, REPLACED, publish_directory, recover_replaced

    directory = tmp_path / "weights" / "step"
    _write(directory, "old")
    _write(tmp_path / "weights" / f"step{PARTIAL}", "new")
    real_replace = os.replace

    def crash_on_the_second_rename(src, dst):
        if str(src).endswith(PARTIAL):
            raise OSError("killed")
        real_replace(src, dst)

    with monkeypatch.context() as patch:
        patch.setattr(service_module.os, "replace", crash_on_the_second_rename)
        with pytest.raises(OSError, match="killed"):
            publish_directory(str(tmp_path / "weights" / f"step{PARTIAL}"), str(directory))
    assert not directory.exists() and (tmp_path / "weights" / f"step{REPLACED}").is_dir()
    recover_replaced(str(directory))
    assert (directory / "adapter.safetensors").read_text() == "old"
    assert not (tmp_path / "weights" / f"step{REPLACED}").exists()
    # Without a crash: the new one in place, nothing left aside.
    publish_directory(str(tmp_path / "weights" / f"step{PARTIAL}"), str(directory))
    assert (directory / "adapter.safetensors").read_text() == "new"
    assert sorted(p.name for p in (tmp_path / "weights").iterdir()) == ["step"]
    # A copy left aside beside a complete new one is deleted, the new one kept.
    _write(tmp_path / "weights" / f"step{REPLACED}", "old")
    recover_replaced(str(directory))
    assert (directory / "adapter.safetensors").read_text() == "new"
    assert sorted(p.name for p in (tmp_path / "weights").iterdir()) == ["step"]


def test_a_starting_server_puts_back_a_checkpoint_an_interrupted_overwrite_moved_aside(tiny_model, tmp_path):
    from skyrl_tinker.service import REPLACED, TinkerService
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
