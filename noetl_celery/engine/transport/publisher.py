"""One publisher per process: the producer that sends decided messages, kept between publishes.

Celery's `apply_async` without a producer takes one from the app's producer pool for every
message, and kombu's Redis channel builds a new `redis.Redis` client object for every `LPUSH`
(`Channel.conn_or_acquire`): about 90 µs of CPU per message, a third of a publish. Here each
process (each thread, for the embedded thread pool: kombu channels are not thread-safe) keeps
one connection, one producer, and on Redis one client over that channel's connection pool.

Forked children never use their parent's: the publisher is keyed by pid, and
`engine/transport/process.reset_after_fork` drops it (without closing: the socket belongs to the parent).
A connection that fails is handled by kombu as before (`Connection.ensure` revives the
producer's channel); a revived Redis channel gets its reused client on the next publish.
"""

from __future__ import annotations

import os
import threading
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from noetl_celery.store import clock

SENT_HEADER = "noetl_sent"  # a task message's publish time (epoch seconds): a worker that takes it
# late checks whether its attempt was recorded meanwhile (attempts._late)

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
        self.declared: dict[str, Any] = {}  # queue name -> the channel it was declared on
        self.options: dict[str, dict[str, Any]] = {}  # queue name -> `send_task`'s publish options

    def publish_options(self, queue: str) -> dict[str, Any]:
        """How `send_task` publishes to `queue`, read from the app's configuration once."""
        options = self.options.get(queue)
        if options is None:
            conf = self.app.conf
            target = self.app.amqp.queues[queue]
            options = self.options[queue] = {
                "exchange": "",  # Celery's send_task_message: a direct queue via the anonymous exchange
                "routing_key": target.name,
                "serializer": conf.task_serializer,
                "compression": conf.task_compression,
                "retry": conf.task_publish_retry,
                "retry_policy": dict(conf.task_publish_retry_policy or {}),
                "delivery_mode": target.exchange.delivery_mode or _PERSISTENT,
            }
        return options

    def declare(self, queue: str) -> list[Any] | None:
        """The queue to declare with a publish: on the first one on each channel (kombu also
        remembers what a channel declared, but asking it costs a fifth of a publish)."""
        channel = self.producer.channel
        if self.declared.get(queue) is channel:
            return None
        self.declared[queue] = channel
        return [self.app.amqp.queues[queue]]

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
    return _publisher(app).ready()


def _publisher(app: Any) -> _Publisher:
    publisher: _Publisher | None = getattr(_local, "publisher", None)
    if (
        publisher is None
        or publisher.pid != os.getpid()
        or publisher.generation != _generation
        or publisher.app is not app
    ):
        publisher = _Publisher(app)
        _local.publisher = publisher
    return publisher


def send_task(
    app: Any,
    name: str,
    kwargs: dict[str, Any],
    *,
    queue: str,
    shadow: str | None = None,
    argsrepr: str | None = None,
    kwargsrepr: str | None = None,
    soft_time_limit: float | None = None,
    time_limit: float | None = None,
    retry_policy: dict[str, Any] | None = None,
) -> str:
    """Publish one task message now (no countdown) through this process's producer; returns its
    task id.

    The message is Celery's own (`app.amqp.as_task_v2`: the same headers, properties and body
    as `apply_async` sends), published the way Celery's `send_task_message` publishes to a direct
    queue: the anonymous exchange, the queue's name as routing key, the queue declared (once per
    channel), the app's retry policy merged with `retry_policy`. What is left out is the
    per-call work of `send_task` that a noetl task message does not need: merging the task's
    options again, routing by name, reading the configuration, the publish signals (nothing
    here listens to them; `task_send_sent_event` is off), the parent's list of children and the
    AsyncResult: 95 of a publish's 275 µs of CPU, measured on Redis. A message with a countdown
    goes through `apply_async`, which handles ETAs and RabbitMQ's native delayed delivery.
    Results are never stored (`ignore_result`), as for every noetl task."""
    task_id = str(uuid.uuid4())
    parent = app.current_worker_task
    root_id = parent_id = None
    if parent is not None and parent.request.id:
        root_id = parent.request.root_id or parent.request.id
        parent_id = parent.request.id
    message = app.amqp.as_task_v2(
        task_id,
        name,
        (),
        kwargs,
        reply_to=app.thread_oid,
        time_limit=time_limit,
        soft_time_limit=soft_time_limit,
        root_id=root_id or task_id,
        parent_id=parent_id,
        shadow=shadow,
        ignore_result=True,
        argsrepr=argsrepr,
        kwargsrepr=kwargsrepr,
    )
    message.headers[SENT_HEADER] = round(clock.epoch(), 3)
    publisher = _publisher(app)
    sender = publisher.ready()
    options = publisher.publish_options(queue)
    if retry_policy:
        options = {**options, "retry_policy": {**options["retry_policy"], **retry_policy}}
    with sender.connection._reraise_as_library_errors():  # as send_task: kombu's error types
        sender.publish(
            message.body, declare=publisher.declare(queue), headers=message.headers, **options, **message.properties
        )
    return task_id


_PERSISTENT = 2  # kombu's delivery mode of a persistent message, Celery's default


def forget() -> None:
    """Drop every thread's publisher (a forked child: the connections are its parent's)."""
    global _generation
    _generation += 1
    _local.__dict__.pop("publisher", None)
