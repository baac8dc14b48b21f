"""noetl_celery's worker app, but the nats cursor driver of the first pool process to pull
messages for a claim is killed (SIGKILL) right after that pull, before the slot's record of it:
the moment a kill leaves messages delivered, unacknowledged and named by no record until AckWait
(cursors/nats.py). Once in all the workers run with it: the process that first creates the file
named by NOETL_TEST_LOST_PULL_MARK dies; every other process runs the driver as it is.

`celery -A tests.support.lost_pull_app worker` (WorkerProcess(app="tests.support.lost_pull_app")).
"""

from __future__ import annotations

import os
import signal
from typing import Any

from noetl_celery.app import app
from noetl_celery.cursors import nats as nats_cursor

__all__ = ["app"]

_keep = nats_cursor._Slot._keep


def _first() -> bool:
    try:
        os.close(os.open(os.environ["NOETL_TEST_LOST_PULL_MARK"], os.O_CREAT | os.O_EXCL | os.O_WRONLY))
    except FileExistsError:
        return False
    return True


async def _killed_after_a_pull(self: Any, kv: Any, record: dict[str, Any], last: int) -> int:
    if record.get("held") and _first():
        os.kill(os.getpid(), signal.SIGKILL)
    return await _keep(self, kv, record, last)


nats_cursor._Slot._keep = _killed_after_a_pull  # type: ignore[method-assign]
