"""The postgres cursor driver: each claim is its own committed transaction on a pooled connection.

It runs through the postgres tool (same connection cache, DSN handling, error kinds and SQLSTATE
retry classes); parameters are bound by psycopg2 only when the SQL names one (`%(name)s`), so a
claim without parameters may contain a literal `%`.
"""

from __future__ import annotations

from noetl_celery.core import sql_result
from noetl_celery.cursors import ClaimCall, register
from noetl_celery.tools.base import Outcome, ToolCall, run_tool


@register("postgres")
def claim_postgres(call: ClaimCall) -> Outcome:
    config = {"command": call.sql}
    if "%(" in call.sql:
        config["params"] = call.params  # type: ignore[assignment]
    outcome = run_tool(ToolCall(kind="postgres", config=config, credential=call.credential, timeout=call.timeout))
    if outcome.status != "ok":
        return outcome
    return Outcome.ok({"rows": sql_result.both_forms(outcome.data or {}).get("rows") or []})
