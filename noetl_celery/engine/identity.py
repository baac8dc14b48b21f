"""The identity of the process running an attempt, as event rows name it: the Celery node name
and the pid, read per attempt (a prefork pool forks its children after import)."""

from __future__ import annotations

import os
import socket
from typing import Any

DEFAULT_NODE_PREFIX = "celery"  # Celery's node name without -n: celery@<host>


def node_name(hostname: str | None = None) -> str:
    """The Celery node name (`w2@host`, as Flower shows it); celery@<host> outside a worker."""
    return hostname or f"{DEFAULT_NODE_PREFIX}@{socket.gethostname()}"


def identity(hostname: str | None = None) -> dict[str, Any]:
    """`worker` (the node name) and `pid` of the process running this attempt, read now."""
    return {"worker": node_name(hostname), "pid": os.getpid()}
