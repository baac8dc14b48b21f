"""One publisher per process: the producer that sends decided messages, kept between publishes.

Celery's `apply_async` without a producer takes one from the app's producer pool for every
message, and kombu's Redis channel builds a new `redis.Redis` client object for every `LPUSH`
(`Channel.conn_or_acquire`): about 90 µs of CPU per message, a third of a publish. Here each
process (each thread, for the embedded thread pool: kombu channels are not thread-safe) keeps
one connection, one producer, and on Redis one client over that channel's connection pool.

Forked children never use their parent's: the publisher is keyed by pid, and
`engine/process.reset_after_fork` drops it (without closing: the socket belongs to the parent).
A connection that fails is handled by kombu as before (`Connection.ensure` revives the
producer's channel); a revived Redis channel gets its reused client on the next publish.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

_local = threading.local()
_generation = 0  # bumped by forget(): every thread's publisher is then rebuilt


class _Publisher:
    def __init__(self, app: Any) -> None:
        self.pid = os.getpid()
        self.generation = _generation
        self.app = app
        self.connection = app.connection_for_write()
        self.producer = app.amqp.Producer(self.connection)
        self.patched: Any = None

    def ready(self) -> Any:
        """The producer, its channel's Redis client reused (done again after a revive)."""
        channel = self.producer.channel  # the channel kombu revives after a connection error
        if channel is not self.patched:
            _reuse_redis_client(channel)
            self.patched = channel
        return self.producer


def _reuse_redis_client(channel: Any) -> None:
    """On kombu's Redis channel, publish through one client instead of one per message."""
    if not (hasattr(channel, "conn_or_acquire") and hasattr(channel, "Client") and hasattr(channel, "pool")):
        return  # another transport (RabbitMQ, memory): nothing to reuse
    client = channel.Client(connection_pool=channel.pool)

    @contextmanager
    def conn_or_acquire(given: Any = None) -> Iterator[Any]:
        yield given or client

    channel.conn_or_acquire = conn_or_acquire


def producer(app: Any) -> Any:
    """This process's (and thread's) producer for `app`, created on first use."""
    publisher: _Publisher | None = getattr(_local, "publisher", None)
    if (
        publisher is None
        or publisher.pid != os.getpid()
        or publisher.generation != _generation
        or publisher.app is not app
    ):
        publisher = _Publisher(app)
        _local.publisher = publisher
    return publisher.ready()


def forget() -> None:
    """Drop every thread's publisher (a forked child: the connections are its parent's)."""
    global _generation
    _generation += 1
    _local.__dict__.pop("publisher", None)
