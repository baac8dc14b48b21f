"""What belongs to one worker process: its identity in event rows, and the caches a forked
child must not inherit from its parent.

Both are taken per attempt or reset in `worker_process_init`, never at import: a prefork pool
imports the app once in the parent and forks its children from it.
"""

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


def reset_after_fork() -> None:
    """Forget everything per process that a forked child inherited: pooled database
    connections, the publisher, cached execution states, loop collections and credential files."""
    from noetl_celery import credentials, publisher
    from noetl_celery.engine import loops
    from noetl_celery.engine.context import STATE
    from noetl_celery.store.db import dispose_engines

    dispose_engines()
    publisher.forget()
    STATE.clear()
    loops.forget_collections()
    credentials.forget_cached_files()
