"""kombu's Redis transport, with channels that fail as connection errors once their connection is
closed.

When the broker connection breaks, Celery's consumer collects the connection: the transport lets
go of its connection parameters. Channels of that connection still live: the consumer's default
channel, which the consumer then closes, and the channel of every delivery taken before the break,
which the worker acknowledges when its task ends. On kombu's transport each of them, needing a
Redis client again, reads the parameters that are gone and raises ``AttributeError``
(``'NoneType' object has no attribute 'hostname'``). That is not a connection error, so Celery does
not handle it: the worker stops with "Unrecoverable error" instead of reconnecting. A Redis restart
in the middle of a loop did that to every worker holding a message.

Here such a channel raises redis' ``ConnectionError``, which Celery and kombu handle as the broken
connection it is: the close gives up requeueing, the acknowledgement is logged as not done. Nothing
is lost: the messages stay in Redis' set of unacknowledged messages and kombu restores them once
their visibility timeout has passed; when Redis lost them, the sweeper re-publishes their attempts.
"""

from __future__ import annotations

from typing import Any

import kombu.transport
from kombu.transport import redis as kombu_redis
from kombu.utils.json import dumps
from redis.exceptions import ConnectionError as RedisConnectionError

SCHEMES = ("redis", "rediss")


class Channel(kombu_redis.Channel):  # type: ignore[misc]
    def _connparams(self, asynchronous: bool = False) -> dict[str, Any]:
        transport = self.connection
        if transport is None or transport.client is None:
            raise RedisConnectionError("the broker connection of this channel is closed")
        params: dict[str, Any] = super()._connparams(asynchronous=asynchronous)
        return params

    def _put_fanout(self, exchange: Any, message: Any, routing_key: Any, **kwargs: Any) -> None:
        """Publish a fanout message (Celery's task events, for Flower) with one client per channel.

        kombu builds a new ``redis.Redis`` for every fanout publish; its constructor costs about as
        much as the PUBLISH itself, and a worker's main process sends several task events per
        task. The client kept here shares the channel's connection pool, as kombu's would, and
        is built again when the pool is (after a reconnection)."""
        if kwargs.get("_publish_batch") is not None:
            super()._put_fanout(exchange, message, routing_key, **kwargs)
            return
        pool = self.pool
        client = self.__dict__.get("_fanout_client")
        if client is None or client.connection_pool is not pool:
            client = self.__dict__["_fanout_client"] = self._create_client()
        payload = dumps(message)
        for topic in self._get_publish_topics(exchange, routing_key):
            client.publish(topic, payload)


class Transport(kombu_redis.Transport):  # type: ignore[misc]
    Channel = Channel


def install() -> None:
    """Make the redis:// and rediss:// URLs of this process use this transport (kombu looks a
    URL's scheme up in its table of transport names). URLs keep their scheme, so what reads them,
    Flower's broker view among others, sees Redis as before."""
    for scheme in SCHEMES:
        kombu.transport.TRANSPORT_ALIASES[scheme] = f"{__name__}:Transport"
        kombu.transport._transport_cache.pop(scheme, None)  # a look-up made before this one
