"""A collection loop's completion reads its iterations' ends in iteration order (`LoopEnds`,
Reads.iteration_ends) and, above the row cap, stores its result as the JSON is written
(blobs.put_streamed): the same result, failures and reference as the rows held at once give
(`_final_rows`, `_ordered_results`, `_first_failures`, then blobs.put of the whole value), on
SQLite and PostgreSQL, through the decision's own transaction."""

from __future__ import annotations

import json
import zlib
from types import SimpleNamespace
from typing import Any

import pytest

from noetl_celery.config import secret_registry
from noetl_celery.core import vocabulary as ev
from noetl_celery.engine.decision import loops
from noetl_celery.engine.decision.store_reads import StoreReads
from noetl_celery.store import blobs, events, repo
from noetl_celery.store.db import decision_transaction, migrate, transaction
from tests.support.reads import ReadsInMemory

EXECUTION = 41
RUN = "41.fan"
SECRET = "loop-completion-s3cret"
PLAN = {"name": "p", "steps": {}}


@pytest.fixture(autouse=True)
def clean_cache():
    blobs.CACHE.clear()
    yield
    blobs.CACHE.clear()


def _end(iteration: int | None, *, failed: bool, payload: Any, run_id: str = RUN, n: int = 0) -> dict[str, Any]:
    return {
        "execution_id": EXECUTION,
        "event_id": f"{run_id}.{iteration}.{n}.{'failed' if failed else 'done'}",
        "event_type": ev.ITERATION_FAILED if failed else ev.ITERATION_COMPLETED,
        "run_id": run_id,
        "iteration": iteration,
        "status": "failed" if failed else "completed",
        "error" if failed else "result": payload,
    }


def _history(total: int) -> list[dict[str, Any]]:
    """Every iteration's ends but the last one's (the current iteration), with retries, failures,
    tolerated failures, an iteration with no end, another run's rows and rows of no iteration."""
    rows = []
    for i in range(total - 1):
        if i == 11:
            continue  # no end recorded: its result is None
        if i in (3, 40):  # failed, then resumed and completed: the later end wins
            rows.append(_end(i, failed=True, payload={"kind": "python", "message": f"first try {i}"}, n=1))
        if i in (5, 7, 9, 17, 23):
            rows.append(_end(i, failed=True, payload={"kind": "http", "message": f"boom {i}", "task": "t"}))
            continue
        if i == 13:
            rows.append(_end(i, failed=True, payload="a plain string error"))  # not a mapping
            continue
        result: Any = {"i": i, "name": f"item-{i}", "nested": [i, None, True, 1.5, "é"]}
        if i % 7 == 0:
            result = None if i % 2 else [i, {"k": "v"}]
        if i == 21:
            result = f"carries {SECRET}"
        rows.append(_end(i, failed=False, payload=result))
    rows.append(_end(4, failed=True, payload={"kind": "python", "message": "later failure of 4"}, n=2))
    rows.append(_end(1, failed=False, payload="elsewhere", run_id="41.other"))
    rows.append(_end(None, failed=False, payload="no iteration"))
    rows.append(_end(3, failed=False, payload={"i": 3, "again": True}, n=3))  # after its failure
    return rows


def _decided() -> list[dict[str, Any]]:
    """Ends decided in this same event, not written yet: they win over every recorded end."""
    return [
        _end(6, failed=False, payload={"decided": 6}),
        _end(9, failed=False, payload={"decided": 9, "secret": SECRET}),
        _end(15, failed=True, payload={"kind": "loop", "message": "decided failure"}),
        _end(15, failed=True, payload={"kind": "loop", "message": "decided failure, later"}),
        _end(2, failed=False, payload="another run's", run_id="41.other"),
    ]


def _current(total: int, case: str) -> tuple[Any, dict[str, Any]]:
    last = SimpleNamespace(iteration=total - 1, run_id=RUN)
    if case == "ok":
        return last, {"ok": True, "data": {"current": True, "secret": SECRET}, "error": None}
    if case == "failed":
        return last, {"ok": False, "data": None, "error": {"kind": "python", "message": "current", "task": "x"}}
    # the current iteration is one whose failure was recorded; its new end failed without an error
    return SimpleNamespace(iteration=7, run_id=RUN), {"ok": False, "data": None, "error": None}


def _store(url: str, rows: list[dict[str, Any]]) -> None:
    if url.startswith("sqlite"):
        migrate(url)
    with transaction(url) as conn:
        repo.create_execution(conn, execution_id=EXECUTION, plan=PLAN, workload={})
        repo.insert_events(conn, rows)


def _as_before(decider: Any, message: Any, total: int, current: dict[str, Any]) -> tuple[list[Any], list[Any]]:
    final = loops._final_rows(decider, RUN)
    results = loops._ordered_results(final, message, total, ok=current["ok"], data=current["data"])
    return results, loops._first_failures(final, message, ok=current["ok"], current=current["error"])


def _loop_ends(conn: Any, message: Any, total: int, current: dict[str, Any]) -> tuple[Any, loops.LoopEnds]:
    """A decision's port over the store's rows in `conn`'s transaction, and its loop's ends."""
    decider = SimpleNamespace(reads=StoreReads(lambda: conn, EXECUTION), decided=_decided)
    return decider, loops.LoopEnds(decider, message, total, **current)


@pytest.mark.parametrize("case", ["ok", "failed", "failed_again"])
@pytest.mark.parametrize("plain", [False, True], ids=["zlib", "plain"])
def test_the_streamed_completion_stores_the_value_the_rows_held_at_once_give(either_store, monkeypatch, case, plain):
    secret_registry.register(SECRET)
    monkeypatch.setenv("NOETL_MAX_RESULT_BYTES", "2000")
    monkeypatch.setattr(events, "ENDS_PAGE", 7)  # many pages, an iteration's ends across two of them
    if plain:
        monkeypatch.setattr(blobs, "COMPRESS_WHEN_SAVES", 0.0)  # compressing never pays: written again, plain
    total = 60
    _store(either_store, _history(total))
    message, current = _current(total, case)
    stats = {"total": total, "success": 50, "failed": 10}
    with decision_transaction(either_store) as conn:
        decider, ends = _loop_ends(conn, message, total, current)
        assert ends.within(2000) is None  # above the row cap: nothing built
        ref = blobs.put_streamed(conn, EXECUTION, {"results": None, "stats": stats}, "results", ends.results)
        stored = conn.exec_driver_sql("SELECT encoding, data FROM noetl_blob").fetchall()
        expected, failures = _as_before(decider, message, total, current)
        assert ends.failures == failures and failures
        whole = {"results": expected, "stats": stats}
        assert ref == blobs.put(conn, EXECUTION, whole)  # the same row: the same digest, size, preview
    ((encoding, data),) = stored
    assert encoding == (blobs.PLAIN if plain else blobs.ZLIB)
    raw = bytes(data) if plain else zlib.decompress(bytes(data))
    assert raw == json.dumps(secret_registry.mask(whole), default=str, ensure_ascii=False).encode("utf-8")
    assert SECRET not in raw.decode("utf-8") and SECRET in json.dumps(whole)
    assert len(expected) == total and expected[11] is None and expected[3] == {"i": 3, "again": True}
    assert expected[4] is None and expected[6] == {"decided": 6} and expected[5] is None


def test_below_the_row_cap_the_result_is_built_whole_as_before(either_store, monkeypatch):
    monkeypatch.setenv("NOETL_MAX_RESULT_BYTES", "1000000")
    total = 60
    _store(either_store, _history(total))
    message, current = _current(total, "ok")
    with decision_transaction(either_store) as conn:
        decider, ends = _loop_ends(conn, message, total, current)
        results = ends.within(1_000_000)
        expected, failures = _as_before(decider, message, total, current)
        assert results == expected and ends.failures == failures
        assert blobs.put_streamed(conn, EXECUTION, {"results": None, "stats": {}}, "results", ends.results) is None
        assert conn.exec_driver_sql("SELECT count(*) FROM noetl_blob").scalar() == 0


def test_a_value_above_what_is_stored_is_not_stored_and_the_reader_stops_early(either_store, monkeypatch):
    monkeypatch.setenv("NOETL_MAX_RESULT_BYTES", "1000")
    monkeypatch.setenv("NOETL_MAX_STORED_BYTES", "3000")
    monkeypatch.setattr(events, "ENDS_PAGE", 5)
    total = 60
    _store(either_store, _history(total))
    message, current = _current(total, "ok")
    with decision_transaction(either_store) as conn:
        decider, ends = _loop_ends(conn, message, total, current)
        assert blobs.put_streamed(conn, EXECUTION, {"results": None, "stats": {}}, "results", ends.results) is None
        # the transaction goes on: the cursor left early was closed, the rows read again in full
        expected, _ = _as_before(decider, message, total, current)
        assert list(ends.results()) == expected
        assert conn.exec_driver_sql("SELECT count(*) FROM noetl_blob").scalar() == 0


def test_the_rows_held_in_memory_answer_as_the_store_does():
    rows = [{**row, "id": n} for n, row in enumerate(_history(60), start=1)]
    decider = SimpleNamespace(reads=ReadsInMemory(rows), decided=_decided)
    for case in ("ok", "failed", "failed_again"):
        message, current = _current(60, case)
        ends = loops.LoopEnds(decider, message, 60, **current)
        assert list(ends.results()) == _as_before(decider, message, 60, current)[0]
        assert ends.failures == _as_before(decider, message, 60, current)[1]


def test_an_empty_or_endless_loop_completes_with_its_current_iteration_alone():
    decider = SimpleNamespace(reads=ReadsInMemory([]), decided=list)
    message = SimpleNamespace(iteration=2, run_id=RUN)
    ends = loops.LoopEnds(decider, message, 4, ok=True, data="mine", error=None)
    assert ends.within(100) == [None, None, "mine", None] and ends.failures == []
    ends = loops.LoopEnds(decider, SimpleNamespace(iteration=None, run_id=RUN), 0, ok=True, data=None, error=None)
    assert ends.within(100) == [] and ends.failures == []
