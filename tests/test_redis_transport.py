"""noetl_celery.engine.transport.redis_transport against a real Redis: a channel whose connection was let go fails
as a connection error (Celery handles those), never as AttributeError (which stops a worker)."""

from __future__ import annotations

import pytest
from kombu import Connection

import noetl_celery.app  # noqa: F401  (installs the transport, as every process of ours does)
from noetl_celery.engine.transport import redis_transport


def test_redis_urls_use_the_transport_and_keep_their_scheme(redis_url):
    with Connection(redis_url) as conn:
        assert isinstance(conn.transport, redis_transport.Transport)
        assert conn.as_uri().startswith("redis://")
        conn.ensure_connection(max_retries=1)
        assert conn.default_channel.client.ping()


def test_a_channel_of_a_collected_connection_fails_as_a_connection_error(redis_url):
    conn = Connection(redis_url)
    channel = conn.channel()
    conn.collect()  # what Celery's consumer does with a broken connection
    with pytest.raises(conn.connection_errors, match="connection of this channel is closed"):
        channel.queue_purge("noetl-transport-test")


def test_fanout_messages_reach_subscribers_through_one_client_per_channel(redis_url, monkeypatch):
    # Celery's task events are fanout publishes: each must arrive, without a new client per message
    from kombu import Exchange

    created = []
    original = redis_transport.Channel._create_client

    def counting(self, asynchronous=False):
        client = original(self, asynchronous=asynchronous)
        if not asynchronous:
            created.append(client)
        return client

    monkeypatch.setattr(redis_transport.Channel, "_create_client", counting)
    exchange = Exchange("noetl-transport-fanout-test", type="fanout")
    with Connection(redis_url) as conn:
        channel = conn.channel()
        listener = channel.client.pubsub()
        topic = channel._get_publish_topics(exchange.name, "")[0]
        listener.subscribe(topic)
        assert listener.get_message(timeout=2)["type"] == "subscribe"
        producer = conn.Producer(channel, exchange=exchange)
        for n in range(20):
            producer.publish({"n": n}, exchange=exchange, declare=[exchange])
        received = []
        while len(received) < 20:
            message = listener.get_message(timeout=2)
            assert message is not None, f"only {len(received)} of 20 fanout messages arrived"
            if message["type"] == "message":
                received.append(message)
        listener.close()
    assert len(created) == 1
