"""The publisher: one producer per process and thread, rebuilt after a fork."""

from __future__ import annotations

import threading

from celery import Celery

from noetl_celery import publisher


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
