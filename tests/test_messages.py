"""Messages decode tolerantly and say their format: an old message runs, an unknown field is
ignored (logged once), a message too new to read fails its execution instead of vanishing."""

from __future__ import annotations

import logging
from dataclasses import replace
from pathlib import Path

import pytest
from celery import Celery

from noetl_celery.compiler import compile_playbook
from noetl_celery.engine.attempt import worker
from noetl_celery.engine.decision import orchestrator
from noetl_celery.engine.messages import (
    BATCH_VERSION,
    FRAME_VERSION,
    MESSAGE_VERSION,
    READ_VERSION,
    VERSION_FIELD,
    Dispatch,
    MessageError,
    MessageTooNew,
    TaskMessage,
)
from noetl_celery.runner import create_execution, wait
from noetl_celery.store import repo
from noetl_celery.store.db import migrate, transaction

PLAYBOOKS = Path(__file__).resolve().parents[1] / "playbooks"
HELLO = PLAYBOOKS / "hello_world.yaml"

# A task message as workers wrote it before message formats were versioned (no message_version).
OLD_TASK_MESSAGE = {
    "execution_id": 1,
    "run_id": "r1",
    "step": "start",
    "task_index": 0,
    "seq": 0,
    "attempt": 2,
    "page": 1,
    "iteration": None,
    "element": None,
    "iter_vars": {},
    "prev": None,
    "args": {"a": 1},
    "call": {},
    "task_results": {},
    "frames": [],
    "version": 3,
    "parent_event_id": "p",
    "replay": False,
}


def test_an_old_format_task_message_decodes_with_its_values():
    message = TaskMessage.from_dict(OLD_TASK_MESSAGE)
    assert (message.step, message.attempt, message.args, message.version) == ("start", 2, {"a": 1}, 3)
    assert message.to_dict()[VERSION_FIELD] == MESSAGE_VERSION


def test_a_minimal_message_takes_the_defaults_and_a_missing_required_field_is_named():
    message = TaskMessage.from_dict({"execution_id": 1, "run_id": "r", "step": "s"})
    assert message.attempt == 1 and message.iter_vars == {}
    with pytest.raises(MessageError, match="missing field.*run_id"):
        TaskMessage.from_dict({"execution_id": 1, "step": "s"})
    with pytest.raises(MessageError, match="expected an object"):
        TaskMessage.from_dict(["not", "a", "dict"])  # type: ignore[arg-type]


def test_unknown_fields_are_ignored_and_logged_once(caplog):
    caplog.set_level(logging.WARNING, logger="noetl_celery.engine.messages")
    data = {**OLD_TASK_MESSAGE, "added_later_7f3a": {"x": 1}}
    for _ in range(3):
        assert TaskMessage.from_dict(data) == TaskMessage.from_dict(OLD_TASK_MESSAGE)
    notes = [r.getMessage() for r in caplog.records if "added_later_7f3a" in r.getMessage()]
    assert len(notes) == 1 and "task message" in notes[0]
    dispatch = Dispatch.from_dict({"kind": "run", "message": OLD_TASK_MESSAGE, "also_new_7f3a": 1})
    # the old message comes back with the fields added since at their default
    assert dispatch.message == TaskMessage.from_dict(OLD_TASK_MESSAGE).to_dict()
    assert {k: dispatch.message[k] for k in OLD_TASK_MESSAGE if k != VERSION_FIELD} == {
        k: v for k, v in OLD_TASK_MESSAGE.items() if k != VERSION_FIELD
    }


def test_a_message_too_new_is_refused_with_what_to_do():
    with pytest.raises(MessageTooNew, match=rf"format {READ_VERSION + 1}, newer than this worker reads .*upgrade"):
        TaskMessage.from_dict({**OLD_TASK_MESSAGE, VERSION_FIELD: READ_VERSION + 1})
    with pytest.raises(MessageError, match="whole number"):
        TaskMessage.from_dict({**OLD_TASK_MESSAGE, VERSION_FIELD: "two"})


def _old_format(value):
    """A message as an older worker would send it: no format version, and a field unknown here."""
    if isinstance(value, dict):
        return {k: _old_format(v) for k, v in value.items() if k != VERSION_FIELD}
    if isinstance(value, list):
        return [_old_format(v) for v in value]
    return value


def test_an_execution_runs_to_completion_on_old_format_messages(sqlite_url):
    migrate(sqlite_url)
    plan = compile_playbook(PLAYBOOKS / "branching.yaml")
    execution_id = create_execution(plan, sqlite_url)
    pending = orchestrator.handle_event(sqlite_url, {"kind": "start", "execution_id": execution_id})
    handled = 0
    while pending:
        dispatch = Dispatch.from_dict(_old_format(pending.pop(0).to_dict()))
        old_message = {**_old_format(dispatch.message), "priority_hint": "added by a newer version"}
        payload = worker.execute(sqlite_url, TaskMessage.from_dict(old_message), queue_id="q")
        assert payload is not None
        pending += orchestrator.handle_event(sqlite_url, _old_format(payload))
        handled += 1
    assert handled >= 2
    status = wait(sqlite_url, execution_id, timeout=5)
    assert status["status"] == "completed", status


def test_a_task_message_too_new_fails_its_execution_on_a_real_worker(redis_url, migrated_postgres, worker_factory):
    worker_factory(
        env={"NOETL_BROKER_URL": redis_url, "NOETL_DATABASE_URL": migrated_postgres.url},
        concurrency=1,
        name="reader@%h",
    )
    plan = compile_playbook(HELLO)
    execution_id = create_execution(plan, migrated_postgres.url)
    first = orchestrator.handle_event(migrated_postgres.url, {"kind": "start", "execution_id": execution_id})
    future = {**first[0].message, VERSION_FIELD: READ_VERSION + 1, "something_new": True}
    client = Celery("sender", broker=redis_url)
    try:
        client.send_task(
            "noetl.run_task", kwargs={"execution_id": execution_id, "message": future}, queue="noetl.tasks"
        )
        status = wait(migrated_postgres.url, execution_id, timeout=60)
    finally:
        client.close()
    assert status["status"] == "failed", status
    assert "MessageTooNew" in status["error"]["message"] and "upgrade" in status["error"]["message"]
    with transaction(migrated_postgres.url) as conn:
        kinds = [e["event_type"] for e in repo.list_events(conn, execution_id)]
    assert kinds[-1] == "execution.failed"


def test_an_on_event_payload_too_new_fails_its_execution_on_a_real_worker(redis_url, migrated_postgres, worker_factory):
    worker_factory(
        env={"NOETL_BROKER_URL": redis_url, "NOETL_DATABASE_URL": migrated_postgres.url},
        concurrency=1,
        name="decider@%h",
    )
    execution_id = create_execution(compile_playbook(HELLO), migrated_postgres.url)
    client = Celery("sender", broker=redis_url)
    try:
        client.send_task(
            "noetl.on_event",
            queue="noetl.events",
            kwargs={
                "execution_id": execution_id,
                "event": {"kind": "start", "execution_id": execution_id, VERSION_FIELD: READ_VERSION + 5},
            },
        )
        status = wait(migrated_postgres.url, execution_id, timeout=60)
    finally:
        client.close()
    assert status["status"] == "failed" and "newer than this worker reads" in status["error"]["message"]


def test_the_wire_form_leaves_out_defaults_and_decodes_to_the_same_message():
    from noetl_celery.engine.messages import wire

    message = TaskMessage(
        execution_id=7, run_id="r", step="work", iteration=3, element={"x": 1}, parent_event_id="p", version=2
    )
    sent = message.to_wire()
    assert set(sent) == {
        "execution_id",
        "run_id",
        "step",
        "iteration",
        "element",
        "parent_event_id",
        "version",
        VERSION_FIELD,
    }
    assert TaskMessage.from_dict(sent) == message
    assert wire(message.to_dict()) == sent  # the dict form, as publish sends a stored dispatch
    assert TaskMessage.from_dict(wire(OLD_TASK_MESSAGE)) == TaskMessage.from_dict(OLD_TASK_MESSAGE)
    # values equal to a default but of another kind are kept (0 is not the default attempt 1)
    assert wire({**message.to_dict(), "attempt": 0})["attempt"] == 0


def test_a_decision_row_keeps_a_dispatch_in_its_wire_form_and_reads_it_back_whole():
    message = TaskMessage(execution_id=7, run_id="r", step="work", iteration=3, element=[1, 2], parent_event_id="p")
    dispatch = Dispatch.task(message, label="pb:work", timeout=12.0)
    stored = dispatch.stored()
    # the fields at their default are left out, and the format version 1
    assert stored["message"] == {k: v for k, v in message.to_wire().items() if k != VERSION_FIELD}
    assert len(str(stored)) < len(str(dispatch.to_dict())) * 0.7
    assert Dispatch.from_dict(stored) == dispatch  # every field back, as the decision dispatched it
    # a dispatch stored whole (by an earlier version) reads as it was
    assert Dispatch.from_dict(dispatch.to_dict()) == dispatch
    # the dispatch's own fields at their default are left out too, and read back
    plain = Dispatch.task(message, label="pb:work")
    assert plain.stored() == {"kind": "run", "message": stored["message"], "label": "pb:work"}
    # a batch keeps its format version (2): an older reader refuses it rather than run one iteration
    batch = Dispatch.task(replace(message, batch=[{"iteration": 4, "element": [3]}]), label="pb:work")
    assert batch.stored()["message"][VERSION_FIELD] == BATCH_VERSION
    assert Dispatch.from_dict(batch.stored()) == batch
    # a cursor row naming its frame by reference keeps its format (3): an older reader would take
    # the frame for over after this row, and refuses it instead
    framed = Dispatch.task(
        replace(
            message, slot={"id": 0, "claim": 1, "phase": "row", "index": 4, "frame": {"at": "k", "size": 3, "pos": 1}}
        ),
        label="pb:work",
    )
    assert framed.stored()["message"][VERSION_FIELD] == FRAME_VERSION == framed.message[VERSION_FIELD]
    assert TaskMessage.from_dict(framed.message).to_wire()[VERSION_FIELD] == FRAME_VERSION
    assert Dispatch.from_dict(framed.stored()) == framed
    assert Dispatch.from_dict(plain.stored()) == plain
    # an event for on_event (a sub-playbook's start or end) keeps its message as it is
    event = Dispatch(kind="event", message={"kind": "child_done", "execution_id": 7}, countdown=1.0)
    assert event.stored() == {"kind": "event", "message": event.message, "countdown": 1.0}
    assert Dispatch.from_dict(event.stored()) == event
