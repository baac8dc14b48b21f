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
from redis.exceptions import ConnectionError as RedisConnectionError

SCHEMES = ("redis", "rediss")


class Channel(kombu_redis.Channel):  # type: ignore[misc]
    def _connparams(self, asynchronous: bool = False) -> dict[str, Any]:
        transport = self.connection
        if transport is None or transport.client is None:
            raise RedisConnectionError("the broker connection of this channel is closed")
        params: dict[str, Any] = super()._connparams(asynchronous=asynchronous)
        return params


class Transport(kombu_redis.Transport):  # type: ignore[misc]
    Channel = Channel


def install() -> None:
    """Make the redis:// and rediss:// URLs of this process use this transport (kombu looks a
    URL's scheme up in its table of transport names). URLs keep their scheme, so what reads them,
    Flower's broker view among others, sees Redis as before."""
    for scheme in SCHEMES:
        kombu.transport.TRANSPORT_ALIASES[scheme] = f"{__name__}:Transport"
        kombu.transport._transport_cache.pop(scheme, None)  # a look-up made before this one
