"""A cursor slot's claim on a worker: render the claim SQL, bind the slot id, run the driver.

The claim SQL is rendered with Jinja first (the step's render context plus each frame value as
`__frame_<name>`, e.g. `{{ __frame_max_rows }}`, and `__worker_slot_id`); `%(name)s` parameters
are then bound by the driver. The outcome's data is `{"rows": [...]}`.

A claim that runs its first row in its own job (`slot.run`, engine/decision/cursor_loop.py) on a
SQL driver keeps the rows it took in the event store (noetl_cursor_hold) before that row runs:
the same claim run again (its job died before the row's outcome was recorded, or it was
delivered twice) takes them back (`held`) instead of running the claim SQL, whatever the SQL does
with rows that ran (a row its task marked done would not be claimed again, and would be lost).
The queue drivers keep what a slot took themselves until its next claim acknowledges it.
"""

from __future__ import annotations

from typing import Any

from noetl_celery import cursors
from noetl_celery.config import credentials
from noetl_celery.core.errors import CredentialError, TemplateError
from noetl_celery.core.vocabulary import ToolErrorKind
from noetl_celery.dsl.plan import Step
from noetl_celery.engine.ids import slot_id
from noetl_celery.engine.messages import TaskMessage
from noetl_celery.store.db import transaction
from noetl_celery.store.loops import held_claim, hold_claim
from noetl_celery.templates.render import plain, render_value
from noetl_celery.tools.base import Outcome


def frame_values(step: Step) -> dict[str, Any]:
    frame = (step.loop.frame if step.loop else None) or {}
    return {f"__frame_{name}": value for name, value in frame.items()}


def claim_params(message: TaskMessage) -> dict[str, Any]:
    assert message.slot is not None
    return {cursors.SLOT_PARAM: slot_id(message.run_id, message.slot["id"])}


def run_claim(step: Step, message: TaskMessage, context: dict[str, Any], secrets: set[str]) -> Outcome:
    assert step.loop is not None and step.loop.cursor is not None
    cursor = step.loop.cursor
    params = claim_params(message)
    scope = {**context, **frame_values(step), **params}
    own = {k: v for k, v in cursor.items() if k not in ("kind", "auth", "claim", "retry")}
    try:
        sql = str(plain(render_value(cursor.get("claim"), scope))) if cursor.get("claim") is not None else ""
        options = plain(render_value(own, scope))
        auth = plain(render_value(cursor.get("auth"), scope))
        credential = credentials.resolve(auth) if auth is not None else None
    except TemplateError as exc:
        return Outcome.fail(ToolErrorKind.TEMPLATE, f"cursor claim: {exc}")
    except CredentialError as exc:
        return Outcome.fail(ToolErrorKind.CREDENTIAL, str(exc))
    if credential is not None:
        secrets |= credentials.secret_values(credential)
    lease = (step.loop.frame or {}).get("lease_seconds")
    timeout = float(lease) if isinstance(lease, (int, float)) else None
    return cursors.claim(
        str(cursor.get("kind")),
        cursors.ClaimCall(
            sql=sql,
            params=params,
            credential=credential,
            timeout=timeout,
            options=options,
            done=list((message.slot or {}).get("done") or []),
            max_rows=cursors.frame_rows(step.loop.frame),
        ),
    )


def _holds(step: Step, message: TaskMessage) -> bool:
    """Whether this claim keeps its rows in the event store: it runs its first row, on a SQL driver."""
    assert step.loop is not None and step.loop.cursor is not None and message.slot is not None
    return bool(message.slot.get("run")) and cursors.needs_claim(str(step.loop.cursor.get("kind")))


def held(url: str, step: Step, message: TaskMessage) -> list[Any] | None:
    """The rows this claim took and kept when it ran before (a later attempt of it, or a delivery
    again): None when it keeps none, or cannot have run before, or kept none."""
    if not _holds(step, message) or not (message.replay or message.attempt > 1):
        return None
    assert message.slot is not None
    with transaction(url) as conn:
        return held_claim(conn, message.execution_id, message.run_id, message.slot["id"], message.slot["claim"])


def hold(url: str, step: Step, message: TaskMessage, rows: list[Any]) -> None:
    """Keep the rows this claim took, before the first of them runs (a claim that keeps none: nothing)."""
    if not _holds(step, message):
        return
    assert message.slot is not None
    with transaction(url) as conn:
        hold_claim(conn, message.execution_id, message.run_id, message.slot["id"], message.slot["claim"], rows)
