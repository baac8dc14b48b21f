"""What Flower sees: the task events a real worker sends for each attempt (Flower reads the same
events from the broker). A failed attempt is FAILURE with its error, a retried one RETRY, a
successful one a short outcome line; names stay `playbook:step`; args carry the execution."""

from __future__ import annotations

import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
from celery import Celery

from noetl_celery.runner import execution_events, execution_status, wait
from tests.distributed.test_retry_delivery import submit

PLAYBOOKS = Path(__file__).resolve().parents[1] / "playbooks"
EVENT_TYPES = ("task-received", "task-succeeded", "task-failed", "task-retried")


class TaskEvents:
    """Collects task events from the broker, as Flower does, in a background thread."""

    def __init__(self, broker_url: str):
        self.app = Celery(broker=broker_url)
        self.events: list[dict[str, Any]] = []
        self.ready = threading.Event()
        self.receiver: Any = None
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        with self.app.connection() as conn:
            self.receiver = self.app.events.Receiver(conn, handlers={t: self.events.append for t in EVENT_TYPES})
            ready = self.receiver.on_consume_ready

            def on_ready(*args: Any, **kwargs: Any) -> None:
                ready(*args, **kwargs)
                self.ready.set()

            self.receiver.on_consume_ready = on_ready  # type: ignore[method-assign]
            self.receiver.run()  # a kombu ConsumerMixin: until should_stop

    def __enter__(self) -> TaskEvents:
        self.thread.start()
        assert self.ready.wait(20)
        return self

    def __exit__(self, *exc: object) -> None:
        self.receiver.should_stop = True
        self.thread.join(10)

    def by_type(self, kind: str) -> list[dict[str, Any]]:
        return [e for e in self.events if e["type"] == kind]

    def tasks(self) -> dict[str, dict[str, Any]]:
        """Each task's fields, merged over its events in order, as Celery's event state (which
        Flower keeps) builds a task: an attempt a message ran itself has one event, carrying
        what a published one's task-received carries."""
        merged: dict[str, dict[str, Any]] = {}
        for event in self.events:
            merged.setdefault(event["uuid"], {}).update({k: v for k, v in event.items() if v is not None})
        return merged


DASHBOARD = "http://dashboard.example:8080"  # NOETL_DASHBOARD_URL: each task's args link to its execution


@pytest.mark.parametrize("window", [None, "0"], ids=["default-window-eager-events", "window-off"])
def test_flower_sees_failures_retries_and_outcome_lines(env, store_url, worker_factory, window):
    """One Flower task per attempt, whether a message published it or ran it itself (the default
    eager window with NOETL_EAGER_TASK_EVENTS: engine/transport/task_events.py) or eager
    attempts are off."""
    env = {**env, "NOETL_DASHBOARD_URL": DASHBOARD + "/"}
    if window is None:
        env["NOETL_EAGER_TASK_EVENTS"] = "1"
    else:
        env["NOETL_EAGER_WINDOW"] = window
    worker = worker_factory(env=env, concurrency=2, extra_args=["-E"])
    with TaskEvents(env["NOETL_BROKER_URL"]) as events:
        execution_id = submit(env, PLAYBOOKS / "flower_truth.yaml")
        final = wait(store_url, execution_id, timeout=120)
        assert final["status"] == "failed" and final["failed_step"] == "explode", final
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and not events.by_type("task-failed"):
            time.sleep(0.2)
        time.sleep(1.0)  # the last events of the run

    tasks = events.tasks()
    mine = {u: e for u, e in tasks.items() if f"execution={execution_id}" in (e.get("args") or "")}
    assert mine, tasks
    # the tasks no worker main process received: attempts a message ran itself
    received = {e["uuid"] for e in events.by_type("task-received")}
    ran_eagerly = [e["name"] for u, e in mine.items() if u not in received]
    assert bool(ran_eagerly) == (window is None), ran_eagerly
    names = {e["name"] for e in mine.values() if "run_task" in e["name"] or ":" in e["name"]}
    assert names <= {"flower_truth:start", "flower_truth:work", "flower_truth:explode"}, names

    failed = [e for e in events.by_type("task-failed") if e["uuid"] in mine]
    assert len(failed) == 1, failed
    assert "AttemptFailed" in failed[0]["exception"] and "bad record 99" in failed[0]["exception"]
    assert f"execution={execution_id}" in failed[0]["exception"]
    assert "step=explode" in mine[failed[0]["uuid"]]["args"]
    # Flower's traceback is the playbook code's, not the engine's that raised AttemptFailed
    shown = failed[0]["traceback"]
    assert 'File "<code>", line 1' in shown and "ValueError: bad record 99" in shown, shown
    assert "verdict.py" not in shown and "noetl_celery" not in shown, shown
    # one click from the task to its execution's dashboard page
    assert all(f"{DASHBOARD}/executions/{execution_id}" in e["args"] for e in mine.values()), mine
    # the expected failure is one INFO line with execution, step and error; no traceback
    log = worker.log_text()
    assert "raised unexpected" not in log and "Traceback" not in log, log[-3000:]
    # (Celery's line for a published attempt, the eager line for one a message ran itself)
    expected = [line for line in log.splitlines() if "raised expected" in line or "ran eagerly: failed" in line]
    expected = [line for line in expected if "retried as attempt" not in line]
    assert len(expected) == 1 and "INFO" in expected[0], expected
    assert f"execution={execution_id}" in expected[0] and "step=explode" in expected[0]
    assert "bad record 99" in expected[0]

    retried = [e for e in events.by_type("task-retried") if e["uuid"] in mine]
    assert len(retried) == 1, retried
    assert "flaky record 17" in retried[0]["exception"]
    args = mine[retried[0]["uuid"]]["args"]
    assert "step=work" in args and "attempt=1" in args and "iteration=1" in args, args

    succeeded = [e for e in events.by_type("task-succeeded") if e["uuid"] in mine]
    results = sorted(e["result"] for e in succeeded)
    assert len(succeeded) == 4, results  # start, 3 iterations (17 on its second attempt)
    assert all(r.strip("'\"").startswith(f"ok execution={execution_id}") and len(r) < 200 for r in results)
    assert any("iteration=1" in r and "attempt=2" in r for r in results), results
    assert execution_status(store_url, execution_id)["error"]["message"].startswith("ValueError: bad record 99")
    # raising after the decision took nothing twice: one row per attempt and per decision
    kinds = Counter((r["event_type"], r["step"]) for r in execution_events(store_url, execution_id))
    assert kinds[("iteration.completed", "work")] == 3 and kinds[("iteration.failed", "work")] == 0
    assert kinds[("retry.scheduled", "work")] == 1 and kinds[("action.failed", "explode")] == 1
    assert kinds[("execution.failed", "explode")] == 1 and kinds[("step.completed", "work")] == 1
