"""Eager attempts (engine/transport/eager.py): which dispatch a message may run itself, its time limits, the
setting, and the replay of a redelivered message that ran attempts itself (SQLite and
PostgreSQL). The attempts themselves, on real workers and brokers, are in
tests/distributed/test_eager_attempts.py."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from noetl_celery.compiler import compile_playbook
from noetl_celery.config import settings as noetl_settings
from noetl_celery.core.errors import ConfigurationError
from noetl_celery.engine import deadlines
from noetl_celery.engine.attempt import worker
from noetl_celery.engine.decision import orchestrator
from noetl_celery.engine.messages import Dispatch, TaskMessage
from noetl_celery.engine.transport import eager, process
from noetl_celery.runner import create_execution

THREE_STEPS = Path(__file__).resolve().parents[1] / "bench" / "playbooks" / "three_steps.yaml"


def _dispatch(countdown: float = 0.0, timeout: float = 30.0, kind: str = "run", **fields: object) -> Dispatch:
    message = {"execution_id": 1, "step": "s", "run_id": "r", "attempt": 1, **fields}
    return Dispatch(kind=kind, message=message, countdown=countdown, timeout=timeout)


def _window(seconds: float = 2.0, soft_limit: float | None = 33.0, age: float = 0.0) -> eager.Window:
    return eager.Window(started=time.monotonic() - age, seconds=seconds, soft_limit=soft_limit)


def test_only_one_attempt_due_now_is_taken():
    due = _dispatch()
    assert _window().take([due]) is due
    assert _window().take([_dispatch(countdown=0.5)]) is None  # a backoff goes through the broker
    assert _window().take([_dispatch(kind="event")]) is None  # a sub-playbook's start or end
    assert _window().take([_dispatch(batch=[{"iteration": 2}])]) is None
    claim = _dispatch(slot={"id": 1, "claim": 0, "phase": "claim", "index": 0, "run": True})
    assert _window().take([claim]) is claim  # a cursor claim (and the row it runs), as any attempt
    assert _window().take([_dispatch(child={"status": "ok"})]) is None
    assert _window().take([_dispatch(replay=True)]) is None
    assert _window().take([]) is None
    later = _dispatch()
    assert _window().take([_dispatch(countdown=1), due, later]) is due  # the first that qualifies


def test_an_attempt_is_taken_only_inside_the_window_and_when_its_limits_fit_the_messages():
    assert _window(age=2.5).take([_dispatch()]) is None  # the message is older than the window
    # the message's soft limit (30 s timeout + 1 s grace + a 2 s window) leaves room for an
    # attempt of the same timeout, not for a longer one
    longer, same = _dispatch(timeout=32.5), _dispatch(timeout=30.0)
    assert _window(soft_limit=33.0).take([longer, same]) is same
    assert _window(soft_limit=33.0, age=1.5).take([_dispatch(timeout=31.5)]) is None
    assert _window(soft_limit=None).take([longer]) is longer  # no time limits (an embedded worker)


def test_a_pool_process_asked_to_stop_takes_no_more_attempts(monkeypatch):
    """A SIGTERM to the worker's process group (systemd, supervisord): the pool process finishes
    its running attempt and leaves the next ones to the broker, for the other workers."""
    monkeypatch.setattr(process._Termination, "pool_child", True)
    monkeypatch.setattr(process._Termination, "deferred", False)
    assert _window().take([_dispatch()]) is not None
    process._on_sigterm(signal.SIGTERM, None)  # the first SIGTERM is let pass, and remembered
    assert process.stop_requested()
    assert _window().take([_dispatch()]) is None


def test_a_window_is_read_from_the_setting_and_the_messages_limits():
    request = SimpleNamespace(timelimit=(38.0, 33.0))
    assert eager.window_of(request, 0.0, time.monotonic()) is None  # off
    window = eager.window_of(request, 2.0, 5.0)
    assert window == eager.Window(started=5.0, seconds=2.0, soft_limit=33.0)
    assert eager.window_of(SimpleNamespace(timelimit=None), 2.0, 5.0).soft_limit is None


def test_a_message_carries_the_window_in_its_time_limits():
    assert deadlines.time_limits(30.0) == (31.0, 36.0)
    assert deadlines.time_limits(30.0, 2.0) == (33.0, 38.0)
    # an attempt may be stopped up to the window late: its lease's margin absorbs that
    assert noetl_settings.MAX_EAGER_WINDOW <= deadlines.OUTCOME_MARGIN


def test_the_setting_is_a_number_of_seconds_within_its_bounds():
    assert noetl_settings.load({}).eager_window == 2.0  # the default is the fast path
    assert noetl_settings.load({}).masked()["NOETL_EAGER_WINDOW"] == "2 s"
    assert noetl_settings.load({"NOETL_EAGER_WINDOW": "0"}).masked()["NOETL_EAGER_WINDOW"] == "off"
    chosen = noetl_settings.load({"NOETL_EAGER_WINDOW": "1.5"})
    assert chosen.eager_window == 1.5 and chosen.masked()["NOETL_EAGER_WINDOW"] == "1.5 s"
    for bad in ("-1", "6", "nan"):
        with pytest.raises(ConfigurationError, match="NOETL_EAGER_WINDOW must be between 0"):
            noetl_settings.load({"NOETL_EAGER_WINDOW": bad})
    with pytest.raises(ConfigurationError, match="NOETL_EAGER_WINDOW must be a number of seconds"):
        noetl_settings.load({"NOETL_EAGER_WINDOW": "soon"})


def _run(url: str, dispatch: Dispatch, queue_id: str) -> list[Dispatch]:
    payload = worker.execute(url, TaskMessage.from_dict(dispatch.message), queue_id=queue_id)
    assert payload is not None
    return orchestrator.handle_event(url, payload)


def test_a_pool_process_notes_the_eager_attempt_it_is_in_for_its_main_process(tmp_path, monkeypatch):
    monkeypatch.setattr(eager, "MARKS", tmp_path / "marks")
    first = TaskMessage(execution_id=7, run_id="r", step="middle", parent_event_id="p").to_dict()
    second = TaskMessage(execution_id=7, run_id="r", step="last", parent_event_id="q").to_dict()
    mark = eager.Mark("8f1c/../task id")  # a task id is a file name only once made safe
    mark.note(first)
    mark.note(second)  # rewritten in place: the attempt it is in now
    assert mark.path.parent == tmp_path / "marks"
    # the process died here: the main process reads the note, once
    assert TaskMessage.from_dict(eager.died_in("8f1c/../task id")) == TaskMessage.from_dict(second)
    assert eager.died_in("8f1c/../task id") is None
    # the attempts were over: the note is gone
    over = eager.Mark("other")
    over.note(first)
    over.close()
    assert eager.died_in("other") is None and list((tmp_path / "marks").iterdir()) == []
    # half written (the process died writing it): no attempt named
    mark.path.write_bytes(b'{"execution_id": 7, "ru')
    assert eager.died_in("8f1c/../task id") is None and not mark.path.exists()
    mark.close()


def test_a_workers_start_clears_the_notes_left_by_workers_killed_whole(tmp_path, monkeypatch):
    monkeypatch.setattr(eager, "MARKS", tmp_path / "marks")
    assert eager.clear_stale_notes() == 0  # no note was ever written
    old, live = eager.Mark("killed-with-its-worker"), eager.Mark("running")
    old.note(TaskMessage(execution_id=7, run_id="r", step="s").to_dict())
    live.note(TaskMessage(execution_id=7, run_id="r", step="t").to_dict())
    day_ago = time.time() - eager.STALE_NOTE - 1
    os.utime(old.path, (day_ago, day_ago))
    assert eager.clear_stale_notes() == 1
    assert not old.path.exists() and live.path.exists()
    old.close()
    live.close()


def test_a_redelivered_message_replays_past_the_attempts_it_ran_itself(either_store):
    url = either_store
    execution_id = create_execution(compile_playbook(THREE_STEPS), url)
    [first] = orchestrator.handle_event(url, orchestrator.start_payload(execution_id))
    # message "m1" ran the first step, then the second itself; it died in the third
    [second] = _run(url, first, "m1")
    [third] = _run(url, second, "m1")
    key = TaskMessage.from_dict(first.message).outcome_key()

    replayed = orchestrator.replay(url, execution_id, key, ran_by="m1")
    assert [(d.message["step"], d.message["replay"]) for d in replayed] == [(third.message["step"], True)]
    # a plain replay (or another message's) sends the first step's decision only
    for ran_by in (None, "m2"):
        [plain] = orchestrator.replay(url, execution_id, key, ran_by=ran_by)
        assert plain.message["step"] == second.message["step"]

    # the same message, delivered again without the broker's flag, runs its attempt again: its
    # recorded decision is a duplicate, replayed the same way
    payload = worker.execute(url, TaskMessage.from_dict(first.message), queue_id="m1")
    assert payload is not None
    again = orchestrator.handle_event(url, payload)
    assert [d.message["step"] for d in again] == [third.message["step"]]
