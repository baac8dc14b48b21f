"""The `snowflake` tool: run SQL on Snowflake with snowflake-connector-python (extra `[snowflake]`).

Forms (NoETL's): the SQL in `command` / `commands` (a string, or a list of statements), or
base64-encoded in `command_b64` / `commands_b64` (which win, as in NoETL); the connection from the
task's credential (`auth:`: a mapping with `account`, `user`, `password` or `private_key` (+
`private_key_passphrase`), `warehouse`, `database`, `schema`, `role`, `authenticator`, and for
a private endpoint `host`, `port`, `protocol`) with the same keys written on the task taking
precedence; `warehouse` defaults to COMPUTE_WH and `schema` to PUBLIC, as in NoETL.

Decides: the text is split into statements (tools/sql_text.py: quotes, comments and dollar
quotes respected) and each runs in order on one connection, every statement after a failed one
still run, as NoETL does. Result (NoETL's): `{statement_0: {status: success, row_count, result:
[{COLUMN: value}], columns, query}, statement_1: ...}`; a failed statement is `{status: error,
error, query}` and fails the attempt with kind `sql_error` (`code`: the SQLSTATE), the results of
every statement as the error's data. A refused login fails with kind `authorization`, a server
that cannot be reached with `connection` (retryable). The connector is imported when a call runs.
"""

from __future__ import annotations

import base64
import binascii
from typing import Any

from pydantic import Field

from noetl_celery.core.jsonable import to_jsonable
from noetl_celery.core.vocabulary import ToolErrorKind
from noetl_celery.tools.base import Outcome, ToolCall, register
from noetl_celery.tools.settings import ToolSettings
from noetl_celery.tools.sql_text import split_statements

CONNECTION_KEYS = (
    "account",
    "user",
    "password",
    "private_key",
    "private_key_passphrase",
    "warehouse",
    "database",
    "schema",
    "role",
    "authenticator",
    "host",
    "port",
    "protocol",
)
DEFAULTS = {"warehouse": "COMPUTE_WH", "schema": "PUBLIC"}
QUERY_CHARS = 200  # characters of a statement kept in its result's `query`
LOGIN_TIMEOUT = 30  # seconds to log in
AUTH_ERRNOS = frozenset({390100, 390101, 390144, 251005, 251006})  # login refused, account locked, bad key


class SnowflakeSettings(ToolSettings):
    command: str | list[str] | None = None
    commands: str | list[str] | None = None
    command_b64: str | None = None
    commands_b64: str | None = None
    account: str | None = None
    user: str | None = None
    warehouse: str | None = None
    database: str | None = None
    schema_: str | None = Field(default=None, alias="schema")
    role: str | None = None
    port: int | str | None = None


def sql_text(config: dict[str, Any]) -> str:
    """The SQL the call runs (raises ValueError naming what is wrong)."""
    encoded = config.get("command_b64") or config.get("commands_b64")
    if encoded:
        try:
            return base64.b64decode(str(encoded), validate=True).decode("utf-8")
        except (binascii.Error, UnicodeDecodeError) as exc:
            raise ValueError(f"snowflake: command_b64 is not base64 of UTF-8 text: {exc}") from None
    plain = config.get("command") or config.get("commands")
    if isinstance(plain, list):
        return ";\n".join(str(statement) for statement in plain)
    if isinstance(plain, str) and plain.strip():
        return plain
    raise ValueError("snowflake: give the SQL in `command` (or `commands`, `command_b64`, `commands_b64`)")


def connection_parameters(config: dict[str, Any], credential: Any) -> dict[str, Any]:
    """The connector's arguments: the credential's keys, then the task's, then NoETL's defaults."""
    found: dict[str, Any] = {}
    if isinstance(credential, dict):
        found.update({k: credential[k] for k in CONNECTION_KEYS if credential.get(k) not in (None, "")})
    found.update({k: config[k] for k in CONNECTION_KEYS if config.get(k) not in (None, "")})
    for key, value in DEFAULTS.items():
        found.setdefault(key, value)
    missing = [k for k in ("account", "user") if not found.get(k)]
    if missing:
        raise ValueError(f"snowflake: the connection needs {' and '.join(missing)} (in the credential or on the task)")
    if not (found.get("password") or found.get("private_key") or found.get("authenticator")):
        raise ValueError("snowflake: the connection needs a password or a private_key (in the credential)")
    if found.get("private_key"):
        found["private_key"] = _der_key(str(found["private_key"]), found.pop("private_key_passphrase", None))
    if "port" in found:
        found["port"] = int(found["port"])
    found.setdefault("login_timeout", LOGIN_TIMEOUT)
    return found


def _der_key(pem: str, passphrase: Any) -> bytes:
    """A PEM private key as the DER (PKCS#8) bytes the connector takes."""
    from cryptography.hazmat.primitives import serialization

    key = serialization.load_pem_private_key(pem.encode(), password=str(passphrase).encode() if passphrase else None)
    return key.private_bytes(
        serialization.Encoding.DER, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )


def _preview(statement: str) -> str:
    return statement[:QUERY_CHARS] + ("..." if len(statement) > QUERY_CHARS else "")


def run_statements(conn: Any, statements: list[str], timeout: float | None) -> tuple[dict[str, Any], Any]:
    """Each statement's result by `statement_<n>`, and the first error (None when all ran)."""
    from snowflake.connector import DictCursor

    results: dict[str, Any] = {}
    first_error = None
    with conn.cursor(DictCursor) as cursor:  # one cursor: a `USE ...` holds for the statements after it
        for index, statement in enumerate(statements):
            key = f"statement_{index}"
            try:
                cursor.execute(statement, timeout=int(timeout) if timeout else None)
                results[key] = _statement_result(cursor, statement)
            except Exception as exc:  # the connector's errors: recorded per statement, as NoETL does
                first_error = first_error or exc
                results[key] = {"status": "error", "error": str(exc), "query": _preview(statement)}
    return results, first_error


def _statement_result(cursor: Any, statement: str) -> dict[str, Any]:
    if not cursor.description:
        return {"status": "success", "rows_affected": cursor.rowcount, "query": _preview(statement)}
    rows = cursor.fetchall()
    return {
        "status": "success",
        "row_count": len(rows),
        "result": to_jsonable(rows),
        "columns": [d[0] for d in cursor.description],
        "query": _preview(statement),
    }


@register(
    "snowflake",
    fields={"command", "commands", "command_b64", "commands_b64", "params", *CONNECTION_KEYS, "public_key"},
    required=({"command", "commands", "command_b64", "commands_b64"},),
    settings=SnowflakeSettings,
    extra="snowflake",
    modules=("snowflake.connector",),
)
def run_snowflake(call: ToolCall) -> Outcome:
    """Run the call's statements (see the module docstring)."""
    import snowflake.connector
    from snowflake.connector import errors

    try:
        statements = split_statements(sql_text(call.config))
        parameters = connection_parameters(call.config, call.credential)
    except ValueError as exc:
        return Outcome.fail(ToolErrorKind.INVALID_ARGS, str(exc))
    if not statements:
        return Outcome.fail(ToolErrorKind.INVALID_ARGS, "snowflake: the SQL holds no statement")
    try:
        conn = snowflake.connector.connect(**parameters)
    except errors.DatabaseError as exc:
        if getattr(exc, "errno", None) in AUTH_ERRNOS:
            return Outcome.fail(ToolErrorKind.AUTHORIZATION, f"snowflake: login refused: {exc}")
        return Outcome.fail(ToolErrorKind.CONNECTION, f"snowflake: cannot connect: {exc}", True)
    try:
        results, error = run_statements(conn, statements, call.timeout)
    finally:
        conn.close()
    if error is None:
        return Outcome.ok(results)
    failed = next(key for key, value in results.items() if value["status"] == "error")
    extra = {"code": error.sqlstate} if getattr(error, "sqlstate", None) else {}
    return Outcome.fail(ToolErrorKind.SQL_ERROR, f"snowflake: {failed} failed: {error}", data=results, **extra)
