"""Webhooks: a signed POST once an execution ends with an event its playbook chose.

The URL: the playbook's `executor.spec.webhook` (a URL, or {url, events, secret}), else
NOETL_WEBHOOK_URL (none: nothing is sent). Events: `failed` and `cancelled` unless the playbook's
`events` says otherwise (`completed` too, or instead). Only top-level executions are notified (a
sub-playbook's end is its parent's business).

Signed when a secret is configured (the playbook's `secret`, else NOETL_WEBHOOK_SECRET: the name
of a credential, resolved as a tool's `auth` is; its value, or its `secret`/`value`/`token`
field, is the key): `X-Noetl-Signature: t=<unix seconds>,v1=<hex>`, the HMAC-SHA256 of
`<t>.<the body's bytes>` (`signature`). A receiver recomputes it over the raw body and refuses a
mismatch or an old `t`. `X-Noetl-Event` names the event.

How it is sent, never inside a decision: each sweep (engine/recovery/sweeper.py, every
NOETL_SWEEP_INTERVAL seconds on every worker) looks for executions that ended in the last
NOTIFY_WINDOW with an event and have no delivered notification (a playbook that wants
`completed` gets its notification row when it starts: the scan finds completions through it),
and enqueues the Celery task `noetl.notify` on the event queue for each (a cancel through the CLI
or the API enqueues it at once). The task takes a lease on the execution's row of
noetl_notification (one holder at a time: duplicates of the task return at once), POSTs the JSON
below, and records the attempt. A refused or failed delivery is tried again after 1, 2, 4, ...
seconds (at most BACKOFF_MAX), up to MAX_ATTEMPTS times; once one succeeds (2xx) no other is
made. The task of a failed attempt ends as a failure (Flower shows FAILURE). A worker killed
during a POST leaves its lease to expire, and the delivery is tried again: receivers dedupe by
the `Idempotency-Key` header (one key per execution). An ended execution whose event its
playbook did not choose is recorded as given up (`not chosen`), never sent.

    {"execution_id": "…", "playbook": "name", "path": "catalog/path", "status": "failed",
     "event": "failed", "failed_step": "step", "error": {...}, "finished_at": "…",
     "scheduled": {...} | null, "attempt": 1}

The error is masked as every stored error is (the secret registry): no configured secret is sent.
Delivery state (attempts, last error, next try) is in noetl_notification: `noetl-celery status`
shows it, and store/status.py's `execution_status` carries it for the API.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import time
import uuid
from collections.abc import Callable
from datetime import datetime, timedelta
from typing import Any

from noetl_celery.config import credentials, secret_registry
from noetl_celery.config import settings as noetl_settings
from noetl_celery.core.errors import CredentialError
from noetl_celery.store import schedules as store
from noetl_celery.store.db import transaction
from noetl_celery.store.executions import get_execution
from noetl_celery.store.kernel import utcnow

log = logging.getLogger(__name__)

DELIVERY_TIMEOUT = 10.0  # seconds one POST may take
LEASE_MARGIN = 5.0  # seconds a lease outlives its POST's timeout
BACKOFF_BASE = 1.0  # seconds before the second try; doubles with each failure
BACKOFF_MAX = 300.0
MAX_ATTEMPTS = 10
NOTIFY_WINDOW = timedelta(hours=24)  # executions that ended longer ago are not notified any more
SCAN_LIMIT = 100  # notifications enqueued per sweep
USER_AGENT = "noetl-celery-webhook"
DEFAULT_EVENTS = ("failed", "cancelled")
SIGNATURE_HEADER = "X-Noetl-Signature"
NOT_CHOSEN = "not chosen"  # the last error of a notification whose event its playbook did not choose


def signature(secret: str, body: bytes, at: int | None = None) -> str:
    """The X-Noetl-Signature value of `body`: `t=<unix seconds>,v1=<HMAC-SHA256 of "<t>.<body>">`."""
    at = int(time.time()) if at is None else at
    digest = hmac.new(secret.encode(), str(at).encode() + b"." + body, hashlib.sha256).hexdigest()
    return f"t={at},v1={digest}"


def signing_key(name: str) -> str:
    """The HMAC key the credential `name` holds (its value, or its secret/value/token field)."""
    found = credentials.resolve(name)
    if isinstance(found, dict):
        found = next((found[k] for k in ("secret", "value", "token") if isinstance(found.get(k), str)), None)
    if not isinstance(found, str) or not found:
        raise CredentialError(f"credential {name!r} holds no secret, value or token string")
    return found


def backoff(attempts: int) -> float:
    """Seconds to wait after the `attempts`-th failed try."""
    return float(min(BACKOFF_BASE * 2 ** max(attempts - 1, 0), BACKOFF_MAX))


def pending(settings: noetl_settings.Settings, now: datetime | None = None) -> list[int]:
    """Executions whose notification is due (see the module's docstring). Without
    NOETL_WEBHOOK_URL only those whose playbook names its own webhook."""
    now = now or utcnow()
    with transaction(settings.database_url) as conn:
        return store.unnotified_ends(conn, now - NOTIFY_WINDOW, now, SCAN_LIMIT, own_url_only=not settings.webhook_url)


def wanted(settings: noetl_settings.Settings, execution_id: int, database_url: str | None = None) -> bool:
    """Whether an ended execution has a webhook to call (the setting, or its playbook's own)."""
    if settings.webhook_url:
        return True
    with transaction(database_url or settings.database_url) as conn:
        row = get_execution(conn, execution_id)
    return bool(row and row["parent_execution_id"] is None and (row["plan"] or {}).get("webhook"))


def _message(conn: Any, execution_id: int, attempt: int) -> tuple[dict[str, Any], dict[str, Any]] | None:
    row = get_execution(conn, execution_id)
    if row is None or row["status"] not in ("failed", "cancelled", "completed"):
        return None
    plan = row["plan"] or {}
    finished = store.aware(row["finished_at"])
    message = {
        "execution_id": str(execution_id),
        "playbook": row["playbook_name"],
        "path": row["playbook_path"],
        "status": row["status"],
        "event": row["status"],
        "failed_step": row["failed_step"],
        "error": secret_registry.mask(row["error"]),
        "finished_at": finished.isoformat() if finished else None,
        "scheduled": store.started_by(conn, execution_id),
        "attempt": attempt,
    }
    return message, plan


def deliver(
    settings: noetl_settings.Settings,
    execution_id: int,
    post: Callable[..., Any] | None = None,
) -> tuple[str, float | None]:
    """One delivery attempt of `execution_id`'s notification, when no one else holds it. Returns
    (what happened, seconds until the next try or None): `delivered`, `retry`, `gave_up`,
    `held` (another task holds the lease, or it is not due), `none` (no URL), `not_chosen` (an
    event its playbook did not choose), `gone`."""
    import requests

    post = post or requests.post
    url_of_store = settings.database_url
    token = uuid.uuid4().hex
    now = utcnow()
    with transaction(url_of_store) as conn:
        until = now + timedelta(seconds=DELIVERY_TIMEOUT + LEASE_MARGIN)
        if not store.lease_notification(conn, execution_id, token, until, now):
            return "held", None
        attempts = int((store.notification(conn, execution_id) or {}).get("attempts") or 0)
        found = _message(conn, execution_id, attempts + 1)
    if found is None:
        _record(settings, execution_id, token, None, delivered=False, error="no such ended execution", give_up=True)
        return "gone", None
    message, plan = found
    url = plan.get("webhook") or settings.webhook_url
    if not url:
        _record(settings, execution_id, token, None, delivered=False, error="no webhook configured", give_up=True)
        return "none", None
    events: list[str] = plan.get("webhook_events") or list(DEFAULT_EVENTS)
    if message["event"] not in events:
        skipped = f"{NOT_CHOSEN}: the playbook's webhook events are {', '.join(events)}"
        _record(settings, execution_id, token, None, delivered=False, error=skipped, give_up=True)
        return "not_chosen", None
    secret_name: str | None = plan.get("webhook_secret") if plan.get("webhook") else settings.webhook_secret
    error = _post(post, url, message, execution_id, secret_name)
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


def _post(
    post: Callable[..., Any], url: str, message: dict[str, Any], execution_id: int, secret: str | None
) -> str | None:
    """One POST of `message` (signed with the credential `secret`, when named); its error or None."""
    body = json.dumps(message, separators=(",", ":"), default=str).encode()
    headers = {
        "Content-Type": "application/json",
        "Idempotency-Key": f"noetl-execution-{execution_id}",
        "User-Agent": USER_AGENT,
        "X-Noetl-Event": str(message["event"]),
    }
    try:
        if secret:
            headers[SIGNATURE_HEADER] = signature(signing_key(secret), body)
        answer = post(url, data=body, timeout=DELIVERY_TIMEOUT, headers=headers)
        if not 200 <= answer.status_code < 300:
            return f"HTTP {answer.status_code}"
    except Exception as exc:  # refused, timed out, no such host, no such credential: tried again
        return f"{type(exc).__name__}: {secret_registry.mask_text(str(exc))[:500]}"
    return None


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
    next_at = utcnow() + timedelta(seconds=delay) if delay is not None else None
    with transaction(settings.database_url) as conn:
        store.notification_done(
            conn, execution_id, token, url=shown, delivered=delivered, error=error, next_at=next_at, give_up=give_up
        )
