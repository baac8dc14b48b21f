"""Failure notifications: a webhook called once when an execution fails or is cancelled.

The URL: the playbook's `executor.spec.webhook`, else NOETL_WEBHOOK_URL (none: nothing is
sent). Only top-level executions are notified (a sub-playbook's end is its parent's business).

How it is sent, never inside a decision: each sweep (engine/sweeper.py, every
NOETL_SWEEP_INTERVAL seconds on every worker) looks for executions that ended failed or cancelled
in the last NOTIFY_WINDOW and have no delivered notification, and enqueues the Celery task
`noetl.notify` on the event queue for each (a cancel through the CLI or the API enqueues it at
once). The task takes a lease on the execution's row of noetl_notification (one holder at a time:
duplicates of the task return at once), POSTs the JSON below, and records the attempt. A refused
or failed delivery is tried again after 1, 2, 4, ... seconds (at most BACKOFF_MAX), up to
MAX_ATTEMPTS times; once one succeeds (2xx) no other is made. A worker killed during a POST
leaves its lease to expire, and the delivery is tried again: receivers dedupe by the
`Idempotency-Key` header (one key per execution).

    {"execution_id": "…", "playbook": "name", "path": "catalog/path", "status": "failed",
     "failed_step": "step", "error": {...}, "finished_at": "…", "scheduled": {...} | null,
     "attempt": 1}

The error is masked as every stored error is (the secret registry): no configured secret is sent.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Callable
from datetime import datetime, timedelta
from typing import Any

from noetl_celery import secret_registry
from noetl_celery import settings as noetl_settings
from noetl_celery.store import repo
from noetl_celery.store import schedules as store
from noetl_celery.store.db import transaction

log = logging.getLogger(__name__)

DELIVERY_TIMEOUT = 10.0  # seconds one POST may take
LEASE_MARGIN = 5.0  # seconds a lease outlives its POST's timeout
BACKOFF_BASE = 1.0  # seconds before the second try; doubles with each failure
BACKOFF_MAX = 300.0
MAX_ATTEMPTS = 10
NOTIFY_WINDOW = timedelta(hours=24)  # executions that ended longer ago are not notified any more
SCAN_LIMIT = 100  # notifications enqueued per sweep
USER_AGENT = "noetl-celery-webhook"


def backoff(attempts: int) -> float:
    """Seconds to wait after the `attempts`-th failed try."""
    return float(min(BACKOFF_BASE * 2 ** max(attempts - 1, 0), BACKOFF_MAX))


def pending(settings: noetl_settings.Settings, now: datetime | None = None) -> list[int]:
    """Executions whose notification is due (see the module's docstring). Without
    NOETL_WEBHOOK_URL only those whose playbook names its own webhook."""
    now = now or repo.utcnow()
    with transaction(settings.database_url) as conn:
        return store.unnotified_ends(conn, now - NOTIFY_WINDOW, now, SCAN_LIMIT, own_url_only=not settings.webhook_url)


def wanted(settings: noetl_settings.Settings, execution_id: int, database_url: str | None = None) -> bool:
    """Whether an ended execution has a webhook to call (the setting, or its playbook's own)."""
    if settings.webhook_url:
        return True
    with transaction(database_url or settings.database_url) as conn:
        row = repo.get_execution(conn, execution_id)
    return bool(row and row["parent_execution_id"] is None and (row["plan"] or {}).get("webhook"))


def _message(conn: Any, execution_id: int, attempt: int) -> tuple[dict[str, Any], str | None] | None:
    row = repo.get_execution(conn, execution_id)
    if row is None or row["status"] not in ("failed", "cancelled"):
        return None
    plan = row["plan"] or {}
    finished = store.aware(row["finished_at"])
    message = {
        "execution_id": str(execution_id),
        "playbook": row["playbook_name"],
        "path": row["playbook_path"],
        "status": row["status"],
        "failed_step": row["failed_step"],
        "error": secret_registry.mask(row["error"]),
        "finished_at": finished.isoformat() if finished else None,
        "scheduled": store.started_by(conn, execution_id),
        "attempt": attempt,
    }
    return message, plan.get("webhook")


def deliver(
    settings: noetl_settings.Settings,
    execution_id: int,
    post: Callable[..., Any] | None = None,
) -> tuple[str, float | None]:
    """One delivery attempt of `execution_id`'s notification, when no one else holds it. Returns
    (what happened, seconds until the next try or None): `delivered`, `retry`, `gave_up`,
    `held` (another task holds the lease, or it is not due), `none` (no URL), `gone`."""
    import requests

    post = post or requests.post
    url_of_store = settings.database_url
    token = uuid.uuid4().hex
    now = repo.utcnow()
    with transaction(url_of_store) as conn:
        until = now + timedelta(seconds=DELIVERY_TIMEOUT + LEASE_MARGIN)
        if not store.lease_notification(conn, execution_id, token, until, now):
            return "held", None
        attempts = int((store.notification(conn, execution_id) or {}).get("attempts") or 0)
        found = _message(conn, execution_id, attempts + 1)
    if found is None:
        _record(settings, execution_id, token, None, delivered=False, error="no such ended execution", give_up=True)
        return "gone", None
    message, own_url = found
    url = own_url or settings.webhook_url
    if not url:
        _record(settings, execution_id, token, None, delivered=False, error="no webhook configured", give_up=True)
        return "none", None
    error: str | None = None
    try:
        answer = post(
            url,
            json=message,
            timeout=DELIVERY_TIMEOUT,
            headers={"Idempotency-Key": f"noetl-execution-{execution_id}", "User-Agent": USER_AGENT},
        )
        if not 200 <= answer.status_code < 300:
            error = f"HTTP {answer.status_code}"
    except Exception as exc:  # refused, timed out, no such host: tried again
        error = f"{type(exc).__name__}: {secret_registry.mask_text(str(exc))[:500]}"
    if error is None:
        _record(settings, execution_id, token, url, delivered=True, error=None, give_up=False)
        log.info("execution %s: webhook delivered (attempt %d)", execution_id, attempts + 1)
        return "delivered", None
    tries = attempts + 1
    give_up = tries >= MAX_ATTEMPTS
    delay = backoff(tries)
    _record(settings, execution_id, token, url, delivered=False, error=error, give_up=give_up, delay=delay)
    if give_up:
        log.error("execution %s: webhook not delivered after %d attempts: %s", execution_id, tries, error)
        return "gave_up", None
    log.warning("execution %s: webhook attempt %d failed (%s), next in %.0f s", execution_id, tries, error, delay)
    return "retry", delay


def _record(
    settings: noetl_settings.Settings,
    execution_id: int,
    token: str,
    url: str | None,
    *,
    delivered: bool,
    error: str | None,
    give_up: bool,
    delay: float | None = None,
) -> None:
    shown = noetl_settings.webhook_shown(url) if url else None
    next_at = repo.utcnow() + timedelta(seconds=delay) if delay is not None else None
    with transaction(settings.database_url) as conn:
        store.notification_done(
            conn, execution_id, token, url=shown, delivered=delivered, error=error, next_at=next_at, give_up=give_up
        )
