"""`noetl-celery replay` decides on the execution held in memory (noetl_celery/replay/memory_store.py):
no database but the recorded store it reads, no file.

Executions are recorded on SQLite (tests/support/harness.py); while they are replayed, a
temporary file or directory, a migration, an engine or a SQLite connection for anything but the
recorded store, a decision transaction, the event store's on_event and the process's state cache
all raise. A loop, retries, a fork and its join, a sub-playbook and its children, a cursor loop,
a cancel and values stored by reference replay without a difference all the same. The store in
memory answers as the event store does: a row whose key exists is not written twice, a write on
a head that moved is refused, and what a decision wrote is undone when it raises.
"""

from __future__ import annotations

import sqlite3
import tempfile
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy

from noetl_celery import replay
from noetl_celery.compiler import compile_source
from noetl_celery.engine.context import STATE
from noetl_celery.engine.decision import orchestrator
from noetl_celery.replay.memory_store import MemoryStore
from noetl_celery.store import blobs, db, repo
from noetl_celery.store.decisions import Conflict
from tests.support.engines import REPO_ROOT
from tests.support.harness import run_playbook
from tests.test_replay import RETRIES_AND_A_LOOP, cancelled_after_three_decisions

EXAMPLES = REPO_ROOT / "playbooks"
HELD = """
apiVersion: noetl.io/v10
kind: Playbook
metadata: {name: held}
workflow:
  - step: start
    tool: {kind: python, code: "result = 1"}
"""


@pytest.fixture
def store(tmp_path) -> str:
    url = f"sqlite:///{tmp_path / 'recorded.sqlite'}"
    db.migrate(url)
    return url


def record(url: str, playbook: Path, sets: dict[str, Any] | None = None, *, code: int = 0) -> int:
    exit_code, status = run_playbook(url, playbook, sets)
    assert exit_code == code, status
    return int(status["execution_id"])


def recorded_types(url: str, execution_id: int) -> set[str]:
    with db.transaction(url) as conn:
        return {row["event_type"] for row in repo.list_events(conn, execution_id)}


class Refused(AssertionError):
    """What replay must not do."""


def no_database_but(monkeypatch: pytest.MonkeyPatch, url: str) -> None:
    """From now on only `url` may be read: nothing else is created, migrated or connected to."""
    recorded = db.get_engine(url)
    source = str(Path(recorded.url.database or "").resolve())

    def refuse(what: str) -> Any:
        def refused(*args: Any, **kwargs: Any) -> Any:
            raise Refused(f"replay asked for {what} ({args!r:.200})")

        return refused

    for name in ("TemporaryDirectory", "mkdtemp", "mkstemp", "NamedTemporaryFile", "TemporaryFile"):
        monkeypatch.setattr(tempfile, name, refuse(f"tempfile.{name}"))
    monkeypatch.setattr(db, "migrate", refuse("a migration"))
    monkeypatch.setattr(db, "create_engine", refuse("a new engine"))
    monkeypatch.setattr(sqlalchemy, "create_engine", refuse("a new engine"))
    real_get_engine = db.get_engine

    def only_the_recorded(asked: str) -> Any:
        if asked != url:
            raise Refused(f"replay asked for the store {asked}")
        return real_get_engine(asked)

    monkeypatch.setattr(db, "get_engine", only_the_recorded)
    real_connect = sqlite3.connect

    def connect(database: Any, *args: Any, **kwargs: Any) -> Any:
        if str(Path(str(database)).resolve()) != source:
            raise Refused(f"replay connected to the SQLite database {database!r}")
        return real_connect(database, *args, **kwargs)

    monkeypatch.setattr(sqlite3, "connect", connect)
    monkeypatch.setattr(orchestrator, "decision_transaction", refuse("a decision transaction"))
    monkeypatch.setattr(orchestrator, "handle_event", refuse("the event store's on_event"))
    monkeypatch.setattr(STATE, "get", refuse("the process's state cache"))
    monkeypatch.setattr(STATE, "peek", refuse("the process's state cache"))


def replayed_without_a_difference(url: str, execution_id: int) -> replay.Report:
    report = replay.replay(url, execution_id)
    assert report.difference is None, "\n".join(replay.describe(report))
    return report


def test_replay_decides_without_a_store_of_its_own(store, tmp_path, monkeypatch):
    """A loop, retries, a fork and its join, a sub-playbook and a cursor loop, recorded, then
    replayed with every way to a database or a file but the recorded store refused."""
    retries = tmp_path / "replay_retries.yaml"
    retries.write_text(RETRIES_AND_A_LOOP.replace("JITTER", "true"))
    executions = {
        "a loop": record(store, EXAMPLES / "loop_parallel.yaml"),
        "retries in a loop": record(store, retries),
        "a fork and its join": record(store, EXAMPLES / "fan_out_join.yaml"),
        "a cursor loop": record(store, EXAMPLES / "cursor_queue.yaml"),
    }
    parent = record(store, REPO_ROOT / "tests/playbooks/sub/parent.yaml", {"fail_at": 2}, code=1)
    with db.transaction(store) as conn:
        children = [c["execution_id"] for c in repo.child_executions(conn, parent)]
    assert len(children) == 4
    executions["a sub-playbook"] = parent
    executions.update({f"a sub-playbook's child {i}": child for i, child in enumerate(children)})
    assert {"retry.scheduled", "iteration.failed"} & recorded_types(store, executions["retries in a loop"])
    assert "cursor.item.done" in recorded_types(store, executions["a cursor loop"])
    with db.transaction(store) as conn:
        before = {e: repo.list_events(conn, e) for e in executions.values()}

    no_database_but(monkeypatch, store)
    for what, execution_id in executions.items():
        report = replayed_without_a_difference(store, execution_id)
        assert report.decisions >= 2, what

    monkeypatch.undo()
    with db.transaction(store) as conn:
        assert {e: repo.list_events(conn, e) for e in executions.values()} == before  # nothing written


def test_a_cancel_and_values_stored_by_reference_replay_in_memory(store, tmp_path, monkeypatch):
    """A loop over a result above NOETL_MAX_RESULT_BYTES: its collection and results are kept by
    reference in memory, the worker's result read from the recorded store (nothing cached); then
    an execution cancelled while its loop ran, whose later outcomes are recorded and ignored."""
    monkeypatch.setenv("NOETL_MAX_RESULT_BYTES", "2000")
    big = record(store, REPO_ROOT / "tests/playbooks/loop_big_python.yaml", {"n": 60, "pad": 40})
    with db.transaction(store) as conn:
        rows = repo.list_events(conn, big)
    assert any(blobs.limits.is_reference(r["result"]) for r in rows)
    cancelled = cancelled_after_three_decisions(store, tmp_path)

    no_database_but(monkeypatch, store)
    blobs.CACHE.clear()
    read: list[str] = []
    kept: list[str] = []
    url_reader, put_value = blobs.url_reader, MemoryStore.put_value

    def reader(url: str) -> Any:
        def read_one(ref: Any) -> Any:
            read.append(ref["sha256"])
            return url_reader(url)(ref)

        return read_one

    def put(self: MemoryStore, execution_id: int, value: Any) -> Any:
        stored = put_value(self, execution_id, value)
        if blobs.limits.is_reference(stored):
            kept.append(stored["sha256"])
        return stored

    monkeypatch.setattr(blobs, "url_reader", reader)
    monkeypatch.setattr(MemoryStore, "put_value", put)
    replayed_without_a_difference(store, big)
    assert read and kept  # the worker's result read from the recorded store, the loop's kept in memory
    replayed_without_a_difference(store, cancelled)


def _held(tmp_path: Path, execution_id: int = 11) -> MemoryStore:
    path = tmp_path / "held.yaml"
    path.write_text(HELD)
    plan = compile_source(str(path), {}, None).model_dump(mode="json")
    execution = {
        "execution_id": execution_id,
        "plan": plan,
        "workload": {},
        "parent_execution_id": None,
        "parent_event_id": None,
        "parent_task": None,
        "depth": 0,
    }
    return MemoryStore(execution)


def _row(key: str, **fields: Any) -> dict[str, Any]:
    return {"execution_id": 11, "event_id": key, "event_type": "step.started", **fields}


def test_the_store_in_memory_answers_as_the_event_store(tmp_path):
    store = _held(tmp_path)
    reads = store.reads(11, lambda: None)
    recorded = store.record_decision([_row("a", result=(1, 2), meta={"k": 1})], {"vars": {"x": (3,)}})
    assert recorded.new and recorded.stored == {"vars": {"x": [3]}}  # through JSON, as read back
    assert reads.event("a")["result"] == [1, 2] and reads.event_meta("a") == {"k": 1}
    assert not store.record_decision([_row("a"), _row("b")], {}).new  # its causing row exists: a redelivery
    assert store.state(11).vars == {"x": [3]} and store.state(11).version == 0

    with pytest.raises(Conflict):  # a guarded write on a head that moved
        store.record_decision([_row("c")], {}, head_version=5)
    assert store.bump_execution(11, pending=2, version=1) == (2, 1, "running")
    assert store.finish_execution(11, "completed") and not store.finish_execution(11, "failed")
    assert store.execution_head(11) == {"status": "completed", "pending": 2, "state_version": 1}

    store.create_loop({"run_id": "r", "execution_id": 11, "step": "s", "mode": "parallel", "total": 2,
                       "max_in_flight": 1, "collection": [1, 2], "context": {}})  # fmt: skip
    assert store.claim_loop_indexes("r", 1) == 1
    assert store.loop_iteration_done("r", ok=False, tolerated=True)["failed"] == 1
    assert store.complete_loop("r") and not store.complete_loop("r")
    assert reads.loop("r") is not None and "collection" not in reads.loop("r")
    store.open_join(11, "f", "j", 2)
    assert store.settle_join(11, "f", arrived=True) == (1, 1, 2)

    before = (store.last_event_id(), dict(store.loops["r"]), store.execution_head(11))
    with pytest.raises(RuntimeError), store.transaction():
        store.insert_events([_row("d")])
        store.loop_iteration_done("r", ok=True)
        store.bump_execution(11, pending=-1, version=1)
        raise RuntimeError("the decision failed")
    assert (store.last_event_id(), store.loops["r"], store.execution_head(11)) == before  # undone
    assert reads.event("d") is None


def test_a_value_above_the_row_cap_is_kept_once_by_reference_in_memory(tmp_path, monkeypatch):
    monkeypatch.setenv("NOETL_MAX_RESULT_BYTES", "200")
    store = _held(tmp_path)
    big = [{"id": i, "name": "x" * 20} for i in range(30)]
    ref = store.put_value(11, big)
    assert blobs.limits.is_reference(ref) and store.fetch(ref) == big
    recorded = store.record_decision([_row("a", result=big)], {"result": {"s": big}})
    assert recorded.stored == {"result": {"s": ref}} and store.reads(11, lambda: None).event("a")["result"] == ref
    assert len(store.values) == 1
    with pytest.raises(LookupError):
        store.fetch({**ref, "sha256": "0" * 64})
