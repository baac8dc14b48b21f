"""A worker holds ETA messages by the store's clock (store/clock.py), not its own.

Celery's worker turns a message's ETA into a time of its own timer through this process's wall
clock (kombu's to_timestamp); an ETA is a time on the store's clock (publish.due_at), so the
timer fires when the store's clock reaches it (later by this process's skew when its clock runs
ahead).
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

from kombu.asynchronous.timer import to_timestamp as _kombu_to_timestamp

from noetl_celery.store import clock


def _store_eta(moment: Any, *args: Any, **kwargs: Any) -> Any:
    stamp = _kombu_to_timestamp(moment, *args, **kwargs)
    return stamp + clock.skew() if isinstance(moment, datetime) else stamp


def install_store_eta() -> None:
    """Make this worker's Celery hold ETA messages by the store's clock (idempotent)."""
    from celery.worker import strategy

    strategy.to_timestamp = _store_eta  # type: ignore[attr-defined]
