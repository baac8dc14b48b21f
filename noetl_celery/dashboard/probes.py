"""Liveness, readiness and outages, as the server reports them.

`/health` says only that the process answers (a liveness probe restarts a process that does not;
an unreachable store is no reason to restart it). `/ready` says whether it can serve: the event
store answers and is at this release's schema head, and the broker (when one is configured)
accepts a connection. A load balancer or Kubernetes sends traffic only to a ready server.

`outage` decides which failures of a request are the store's or the broker's being unreachable:
those answer 503 (try again later), never 500 (a defect of the server).
"""

from __future__ import annotations

import time
from typing import Any

from noetl_celery.config import settings as noetl_settings
from noetl_celery.core.errors import BrokerUnavailable
from noetl_celery.store.check import _is_broker_error, first_line, safe_url

BROKER_TIMEOUT = 2.0  # seconds to connect to the broker before /ready says it is unreachable


def outage(exc: BaseException | None) -> str | None:
    """One line naming what is unreachable when `exc` is the store or the broker being down (or
    timing out), None for any other failure."""
    from sqlalchemy import exc as sa

    if exc is None:
        return None
    if isinstance(exc, (sa.OperationalError, sa.InterfaceError, sa.TimeoutError, sa.DisconnectionError)):
        return f"the event store cannot be reached: {first_line(exc)}"
    if isinstance(exc, BrokerUnavailable) or _is_broker_error(exc):
        return f"the broker cannot be reached: {first_line(exc)}"
    return None


def check_store(url: str) -> dict[str, Any]:
    """{"ok": ..., "revision": ..., "head": ..., "error": ...} for the event store at `url`."""
    from noetl_celery.store.db import current_revision, head_revision, shipped_revisions

    head = head_revision()
    started = time.monotonic()
    try:
        revision = current_revision(url)
    except Exception as exc:  # noqa: BLE001 - any failure to read it makes the server unready
        return {"ok": False, "url": safe_url(url), "error": outage(exc) or f"{type(exc).__name__}: {first_line(exc)}"}
    ahead = revision is not None and revision not in shipped_revisions()  # migrated by a newer release
    result: dict[str, Any] = {
        "ok": revision == head or ahead,
        "url": safe_url(url),
        "revision": revision,
        "head": head,
        "seconds": round(time.monotonic() - started, 3),
    }
    if not result["ok"]:
        result["error"] = (
            f"the event store is at revision {revision}, this release needs {head}: run `noetl-celery migrate`"
        )
    return result


def check_broker(broker_url: str | None) -> dict[str, Any]:
    """{"ok": ...} for the broker at `broker_url`; the embedded broker (none configured) is ready
    whenever the process is."""
    if not broker_url:
        return {"ok": True, "url": f"(embedded: {noetl_settings.EMBEDDED_BROKER})"}
    from noetl_celery.engine.transport.broker import connect_once

    started = time.monotonic()
    try:
        connect_once(broker_url, BROKER_TIMEOUT)
    except Exception as exc:  # noqa: BLE001 - whatever kombu raises, the broker is not usable
        return {"ok": False, "url": safe_url(broker_url), "error": f"{type(exc).__name__}: {first_line(exc)}"}
    return {"ok": True, "url": safe_url(broker_url), "seconds": round(time.monotonic() - started, 3)}


def readiness(settings: noetl_settings.Settings) -> dict[str, Any]:
    """The body of /ready: {"status": "ready"|"unready", "store": {...}, "broker": {...}}."""
    store = check_store(settings.database_url)
    broker = check_broker(settings.broker_url)
    return {"status": "ready" if store["ok"] and broker["ok"] else "unready", "store": store, "broker": broker}
