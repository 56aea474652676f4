"""The server's SQLite state without a server."""

from skyrl_tinker.store import FAILED, FutureRow, Store


def test_store_marks_unfinished_work_failed_at_start(tmp_path):
    url = f"sqlite:///{tmp_path / 's.db'}"
    store = Store(url)
    store.add(FutureRow(id="queued", owner="o", model_id=None, kind="optim_step"))
    store.add(FutureRow(id="running", owner="o", model_id=None, kind="optim_step", status="running"))
    store.add(FutureRow(id="done", owner="o", model_id=None, kind="optim_step"))
    store.finish("done", result={"metrics": {}})
    assert Store(url).fail_unfinished() == 2
    rows = {r.id: r for r in Store(url).rows(FutureRow)}
    assert rows["queued"].status == rows["running"].status == FAILED and "did not run to completion" in rows["running"].error
    assert rows["done"].status == "done"
