"""A message the broker delivers again after the attempt it carries was recorded: a worker died
between the decision's commit and the acknowledgement. Real Redis or RabbitMQ, real PostgreSQL,
a real worker process; the redelivery is the broker's own (a consumer that took the message goes
away without acknowledging it: RabbitMQ requeues it flagged `redelivered`, kombu's Redis
transport restores it with the same flag)."""

from __future__ import annotations

from celery import Celery

from noetl_celery.app import configure
from noetl_celery.compiler import compile_playbook
from noetl_celery.compiler.names import RUN_TASK
from noetl_celery.config import settings as noetl_settings
from noetl_celery.engine.attempt import worker
from noetl_celery.engine.context import STATE
from noetl_celery.engine.decision import orchestrator
from noetl_celery.engine.messages import TaskMessage, wire
from noetl_celery.runner import create_execution, wait
from noetl_celery.store import repo
from noetl_celery.store.db import transaction
from tests.support.playbooks import marked_chain
from tests.support.services import on_both_brokers


def _redeliver(settings: noetl_settings.Settings, execution_id: int, message: dict) -> None:
    """Publish the attempt's message, take it as a consumer, and go away without acknowledging it.
    One connection of its own: kombu's pools are shared by every app on the same broker URL."""
    app = Celery("redelivery-test")
    configure(app, settings)
    with app.connection_for_write() as conn:
        app.send_task(
            RUN_TASK,
            kwargs={"execution_id": execution_id, "message": wire(message)},
            queue=settings.task_queue,
            producer=conn.Producer(),
        )
        queue = conn.SimpleQueue(settings.task_queue)
        taken = queue.get(timeout=10)
        assert taken.delivery_info.get("redelivered") in (None, False)  # its first delivery
        queue.close()
    # the connection is closed with the message unacknowledged: back to the queue, flagged


@on_both_brokers
def test_a_redelivered_attempt_that_was_recorded_does_not_run_again(broker, env, store_url, worker_factory, tmp_path):
    marks = tmp_path / "marks.txt"
    playbook = tmp_path / "marked.yaml"
    playbook.write_text(marked_chain("redelivered_attempt", ["start", "second"]))
    plan = compile_playbook(playbook, overrides={"marks": str(marks)})
    execution_id = create_execution(plan, store_url)
    [first] = orchestrator.handle_event(store_url, orchestrator.start_payload(execution_id))
    # the first attempt runs and its decision is recorded, here; the worker that did it "died"
    # before acknowledging its message and before publishing what it decided
    payload = worker.execute(store_url, TaskMessage.from_dict(first.message))
    assert payload is not None
    [second] = orchestrator.handle_event(store_url, payload)
    STATE.clear()
    assert second.message["step"] == "second"
    assert marks.read_text().splitlines() == ["start"]

    settings = noetl_settings.load(env)
    _redeliver(settings, execution_id, first.message)
    worker_factory(env=env, concurrency=2)
    status = wait(store_url, execution_id, timeout=60)
    assert status["status"] == "completed", status
    # the redelivered first attempt did not run its tool again; its decision was sent again
    assert marks.read_text().splitlines() == ["start", "second"]
    with transaction(store_url) as conn:
        kinds = [e["event_type"] for e in repo.list_events(conn, execution_id)]
    assert kinds.count("action.completed") == 2 and kinds.count("execution.completed") == 1


def test_a_recorded_attempt_is_replayed_only_when_the_broker_says_it_was_delivered_before():
    from noetl_celery.engine.transport.attempts import _redelivered

    class Request:
        def __init__(self, info):
            self.delivery_info = info

    assert _redelivered(Request({"redelivered": True}))
    assert not _redelivered(Request({"redelivered": False}))
    assert not _redelivered(Request(None))
    assert not _redelivered(object())
