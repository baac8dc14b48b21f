"""The publisher: one producer per process and thread, rebuilt after a fork."""

from __future__ import annotations

import threading
import time

from celery import Celery

from noetl_celery.engine.transport import publisher


def test_one_producer_is_reused_until_forgotten():
    app = Celery("publisher-test", broker="memory://")
    try:
        first = publisher.producer(app)
        assert publisher.producer(app) is first
        other: list[object] = []
        thread = threading.Thread(target=lambda: other.append(publisher.producer(app)))
        thread.start()
        thread.join()
        assert other[0] is not first  # kombu channels are not shared between threads
        publisher.forget()  # what a forked child does first
        assert publisher.producer(app) is not first
    finally:
        publisher.forget()
        app.close()


def test_a_redis_channel_publishes_through_one_client(redis_url):
    import redis

    app = Celery("publisher-test", broker=redis_url)
    try:
        producer = publisher.producer(app)
        channel = producer.channel
        with channel.conn_or_acquire() as a, channel.conn_or_acquire() as b:
            assert a is b and isinstance(a, redis.Redis)
        producer.publish({"x": 1}, routing_key="publisher-test-queue", serializer="json")
        client = redis.Redis.from_url(redis_url)
        assert client.llen("publisher-test-queue") == 1
        client.delete("publisher-test-queue")
    finally:
        publisher.forget()
        app.close()


def _envelopes(client, queue: str) -> list[dict]:
    import json

    return [json.loads(raw) for raw in reversed(client.lrange(queue, 0, -1))]


def test_send_task_sends_the_message_apply_async_sends(redis_url):
    """publisher.send_task skips send_task's per-call work, not any part of the message: the
    headers, properties and body equal apply_async's but for the ids that are new per message."""
    import base64
    import json

    import redis

    app = Celery("publisher-test", broker=redis_url)
    app.conf.task_ignore_result = True
    queue = "publisher-test-fidelity"

    @app.task(name="publisher.test_task", ignore_result=True)
    def test_task(**_kwargs):  # pragma: no cover - never run, only sent
        return None

    client = redis.Redis.from_url(redis_url)
    client.delete(queue)
    options = {"shadow": "pb:step", "argsrepr": "step=a", "kwargsrepr": "{'x': 1}", "soft_time_limit": 31.0}
    try:
        kwargs = {"execution_id": 7, "message": {"step": "a", "n": [1, 2]}}
        test_task.apply_async(kwargs=kwargs, queue=queue, time_limit=36.0, producer=publisher.producer(app), **options)
        task_id = publisher.send_task(app, "publisher.test_task", kwargs, queue=queue, time_limit=36.0, **options)
        celery_sent, ours = _envelopes(client, queue)
    finally:
        client.delete(queue)
        publisher.forget()
        app.close()
    per_message = {"id", "root_id", "correlation_id", "delivery_tag"}
    assert ours["headers"]["id"] == ours["headers"]["root_id"] == task_id
    # apply_async also copies argsrepr and kwargsrepr (options it passes on) into the properties;
    # workers read them from the headers
    copied = {"argsrepr", "kwargsrepr"}
    assert {k: celery_sent["properties"][k] for k in copied} == {k: options[k] for k in copied}
    # ours also carries its publish time (a worker that takes it late checks for its outcome row)
    assert abs(ours["headers"].pop(publisher.SENT_HEADER) - time.time()) < 60
    for part, left_out in (("headers", per_message), ("properties", per_message | copied)):
        theirs = {k: v for k, v in celery_sent[part].items() if k not in left_out}
        assert {k: v for k, v in ours[part].items() if k not in left_out} == theirs
    assert json.loads(base64.b64decode(ours["body"])) == json.loads(base64.b64decode(celery_sent["body"]))
    assert ours["headers"]["timelimit"] == [36.0, 31.0] and ours["headers"]["shadow"] == "pb:step"
    assert {k: v for k, v in ours.items() if k not in ("headers", "properties", "body")} == {
        k: v for k, v in celery_sent.items() if k not in ("headers", "properties", "body")
    }
