"""The sqlite cursor driver: `UPDATE ... RETURNING` under `BEGIN IMMEDIATE`, committed at once.

The credential (or `auth:` value) names the database file: a path, `sqlite:///path`, or a mapping
with `path`/`database`/`dsn`. `%(name)s` parameters are rewritten to sqlite's `:name` and bound.
BEGIN IMMEDIATE takes the write lock before the claim reads, so two slots never claim one row.
"""

from __future__ import annotations

import re
import sqlite3
from typing import Any

from noetl_celery.core.vocabulary import ToolErrorKind
from noetl_celery.cursors import ClaimCall, register
from noetl_celery.tools.base import Outcome

BUSY_TIMEOUT = 30.0  # seconds a claim waits for another writer's lock
_PARAM = re.compile(r"%\((\w+)\)s")


def database_path(credential: Any) -> str:
    """The file a sqlite credential names; ValueError for a credential without one."""
    value = credential
    if isinstance(credential, dict):
        value = next((credential[k] for k in ("path", "database", "dsn", "url") if credential.get(k)), None)
    if not isinstance(value, str) or not value:
        raise ValueError("sqlite cursor needs a database file: auth: a path, sqlite:///path, or {path: ...}")
    return value.removeprefix("sqlite:///") if value.startswith("sqlite:///") else value


@register("sqlite")
def claim_sqlite(call: ClaimCall) -> Outcome:
    try:
        path = database_path(call.credential)
    except ValueError as exc:
        return Outcome.fail(ToolErrorKind.CREDENTIAL, str(exc))
    sql = _PARAM.sub(r":\1", call.sql)
    names = set(_PARAM.findall(call.sql))
    params = {k: v for k, v in call.params.items() if k in names}
    conn = sqlite3.connect(path, timeout=call.timeout or BUSY_TIMEOUT, isolation_level=None)
    try:
        conn.execute("BEGIN IMMEDIATE")
        try:
            cur = conn.execute(sql, params)
            columns = [d[0] for d in cur.description or ()]
            rows = [dict(zip(columns, r, strict=True)) for r in cur.fetchall()]
            conn.execute("COMMIT")
        except sqlite3.Error:
            conn.execute("ROLLBACK")
            raise
    except sqlite3.OperationalError as exc:
        busy = "locked" in str(exc) or "busy" in str(exc)
        return Outcome.fail(ToolErrorKind.SQL_ERROR, f"sqlite: {exc}", busy)
    except sqlite3.Error as exc:
        return Outcome.fail(ToolErrorKind.SQL_ERROR, f"sqlite: {exc}")
    finally:
        conn.close()
    return Outcome.ok({"rows": rows})
