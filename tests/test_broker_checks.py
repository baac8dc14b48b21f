"""What the engine asks the broker itself, on Redis and on RabbitMQ: whether a queue holds messages
(the sweeper waits for a backlog to drain before re-publishing), with the app's own settings."""

from __future__ import annotations

import time
import uuid

from celery import Celery

from noetl_celery.app import configure
from noetl_celery.config import settings as noetl_settings
from noetl_celery.engine.transport.sweeping import _queues_busy
from tests.support.services import free_port, on_both_brokers


def _busy_within(s: noetl_settings.Settings, app: Celery, want: bool, seconds: float = 3.0) -> bool:
    """The check's answer, asked again for a moment until it is `want` (a publish reaches the queue
    a little after the publisher's call returns)."""
    deadline = time.monotonic() + seconds
    while True:
        busy = _queues_busy(s, app)
        if busy == want or time.monotonic() > deadline:
            return busy
        time.sleep(0.05)


@on_both_brokers
def test_the_queue_busy_check_sees_waiting_messages(broker, broker_url):
    tag = uuid.uuid4().hex[:8]
    s = noetl_settings.load(
        {
            "NOETL_BROKER_URL": broker_url,
            "NOETL_TASK_QUEUE": f"busy.tasks.{tag}",
            "NOETL_EVENT_QUEUE": f"busy.events.{tag}",
        }
    )
    app = Celery(f"busy-{tag}")
    configure(app, s)
    try:
        assert _queues_busy(s, app) is False  # neither queue exists yet
        with app.connection_for_write() as conn:
            tasks, events = conn.SimpleQueue(s.task_queue), conn.SimpleQueue(s.event_queue)
            assert _busy_within(s, app, False) is False  # both exist, both empty
            events.put({"waiting": True})
            assert _busy_within(s, app, True) is True
            events.get(timeout=5).ack()
            assert _busy_within(s, app, False) is False
            for _ in range(3):  # asked every sweep: one pooled connection, not a new one each time
                _queues_busy(s, app)
            assert len(app.pool._dirty) == 0 and app.pool._resource.qsize() >= 1
            tasks.close()
            events.close()
            channel = conn.channel()
            for name in (s.task_queue, s.event_queue):
                channel.queue_delete(name)
            channel.close()
    finally:
        app.pool.force_close_all()


@on_both_brokers
def test_an_unreachable_broker_is_not_busy_and_answers_at_once(broker):
    url = f"amqp://guest:guest@127.0.0.1:{free_port()}//" if broker == "amqp" else f"redis://127.0.0.1:{free_port()}/0"
    s = noetl_settings.load({"NOETL_BROKER_URL": url})
    app = Celery("busy-down")
    configure(app, s)
    started = time.monotonic()
    assert _queues_busy(s, app) is False
    assert time.monotonic() - started < 10
    app.pool.force_close_all()
