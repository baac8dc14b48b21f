"""The `postgres` tool: run SQL text, or write rows into a table, with psycopg2.

Two shapes:

* SQL: `command` (aliases query, sql, statement) is split into its statements (`sql_text`:
  strings, quoted identifiers, comments and `DO $$ ... $$` bodies are kept whole) and they run
  one by one, each committed on its own as psql runs a script and as NoETL does, so a later
  statement sees what an earlier one wrote even while other workers run the same text. The
  text's own `BEGIN; ... COMMIT;` makes the statements between them one transaction. The first
  failing statement stops the text: the error names it ("statement 2 of 3: ..."), statements
  before it stay committed, and a transaction the text opened is rolled back (as is one the
  text leaves open, which is an error). `params` is bound over the whole text, before it is
  split: when the text has positional parameters (`$1`, `$2`, ... outside strings, quoted
  identifiers, dollar-quoted bodies and comments; NoETL's Rust tool) a list binds `$1` to its
  first value, a mapping binds its values in order (or by number when its keys are `1`, `2`,
  ... or `$1`, `$2`, ...), and the number of values must be the highest `$N`; a value binds
  as NoETL's tool sends it (null, boolean, number, text; a mapping or a list as JSON text).
  Otherwise `params` binds `%(name)s` (a mapping) or `%s` (a list). Without `params` no
  parameters are passed, so a literal `%` needs no escaping. Data (sql_result.py): one
  statement is stored flat, `{status: success, rows: [{column: value}], row_count, columns,
  statusmessage, statement_count: 1}` (`affected_rows` too for a statement without rows);
  several are stored as NoETL numbers them, `{status, statement_count, command_0, command_1,
  ...}`, each with the statement fields. Templates read both forms of either (`command_0` of
  a flat result, `rows` of a numbered one: the last statement's); the rows are stored once.
  `autocommit` is accepted and changes nothing.
* table write (the sink shape): `table` + `args` (a mapping column -> value, or a list of them)
  + `mode` insert | append (the same) | upsert (needs `key`: a column or a list of columns;
  ON CONFLICT (key) DO UPDATE SET the other columns; rows repeating a key keep the last one).
  A dict or list value is written as JSON. Data: {row_count, table, mode}.

A table write is one transaction: success commits, an error rolls back. Values
read back go through `to_jsonable`. Errors: kind "sql_error" with code/pg.code = SQLSTATE
(retryable for serialization failures and deadlocks), "connection" when the server cannot be
reached or the connection broke (retryable, except for a wrong role/password/database).
A password never appears in an error message.

Credential: a DSN or URL string, or a mapping {dsn} or {host, port, user, password,
database|dbname|db, sslmode}; without one, the env var NOETL_POSTGRES_DSN is used. `database`
in the config overrides the credential's database. Connections are cached per process and
thread, keyed by DSN. The call's timeout becomes the statement_timeout of each statement.
This module does not log and does not render templates.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections import OrderedDict
from typing import Any

import psycopg2
import psycopg2.extensions
import psycopg2.extras
from psycopg2 import sql
from pydantic import ValidationInfo, field_validator

from noetl_celery.config import settings as noetl_settings
from noetl_celery.core import sql_result
from noetl_celery.core.jsonable import to_jsonable
from noetl_celery.core.vocabulary import ToolErrorKind
from noetl_celery.tools import script as scripts
from noetl_celery.tools.base import Outcome, ToolCall, register
from noetl_celery.tools.settings import ToolSettings
from noetl_celery.tools.sql_text import placeholders, split_statements

DSN_ENV = noetl_settings.POSTGRES_DSN_ENV
CONNECT_TIMEOUT = "10"  # seconds, unless the credential says otherwise
PING_AFTER_IDLE = 30.0  # seconds; a cached connection idle longer is checked before use
MAX_CONNECTIONS_PER_THREAD = 4
INSERT_CHUNK = 1000  # rows per INSERT statement
RETRYABLE_SQLSTATES = frozenset({"40001", "40P01"})  # serialization failure, deadlock
_CREDENTIAL_KEYS = {
    "host": "host",
    "hostname": "host",
    "port": "port",
    "user": "user",
    "username": "user",
    "password": "password",
    "database": "dbname",
    "dbname": "dbname",
    "db": "dbname",
    "sslmode": "sslmode",
    "connect_timeout": "connect_timeout",
    "options": "options",
    "application_name": "application_name",
    "sslrootcert": "sslrootcert",
}
_SQL_KEYS = ("command", "query", "sql", "statement")
# Connect errors that waiting does not cure (wrong role, password or database): not retryable.
_PERMANENT_CONNECT_ERRORS = ("authentication failed", "does not exist", "no pg_hba.conf entry")


class _ConnectionCache(threading.local):
    """Connections of this thread, keyed by DSN; forgotten (not closed) after a fork."""

    def __init__(self) -> None:
        self.pid = os.getpid()
        self.conns: OrderedDict[str, tuple[Any, float]] = OrderedDict()


_cache = _ConnectionCache()
_inherited: list[Any] = []  # connections of a parent process: kept alive, never closed here


def build_dsn(credential: Any, database: str | None = None) -> tuple[str, str | None]:
    """(normalised DSN, password or None) from a credential; ValueError for a bad shape."""
    if credential is None:
        credential = noetl_settings.load().postgres_dsn
        if not credential:
            raise ValueError(f"no postgres credential: give the task an `auth:` or set {DSN_ENV}")
    if isinstance(credential, dict):
        dsn = credential.get("dsn") or credential.get("url") or credential.get("connection_string")
        if dsn:
            parts = psycopg2.extensions.parse_dsn(str(dsn))
        else:
            parts = {
                _CREDENTIAL_KEYS[k]: str(v) for k, v in credential.items() if k in _CREDENTIAL_KEYS and v is not None
            }
            if not parts:
                keys = ", ".join(sorted(str(k) for k in credential)) or "(none)"
                raise ValueError(f"postgres credential has none of dsn/host/user/database (keys: {keys})")
    elif isinstance(credential, str):
        try:
            parts = psycopg2.extensions.parse_dsn(credential)
        except psycopg2.ProgrammingError:
            raise ValueError("postgres credential is not a valid DSN or postgresql:// URL") from None
    else:
        raise ValueError(f"postgres credential must be a DSN string or a mapping, not {type(credential).__name__}")
    if database:
        parts["dbname"] = str(database)
    parts.setdefault("connect_timeout", CONNECT_TIMEOUT)
    parts.setdefault("application_name", "noetl_celery")
    return psycopg2.extensions.make_dsn(**parts), parts.get("password")


def _connection(dsn: str) -> Any:
    """A live connection for `dsn` from this thread's cache, or a new one."""
    if _cache.pid != os.getpid():
        _inherited.extend(conn for conn, _ in _cache.conns.values())
        _cache.conns.clear()
        _cache.pid = os.getpid()
    entry = _cache.conns.pop(dsn, None)
    if entry is not None:
        conn, last_used = entry
        try:
            _end_transaction(conn)  # a call cut short (a soft time limit) may have left one open
            if not conn.closed and time.monotonic() - last_used > PING_AFTER_IDLE:
                with conn.cursor() as cur:
                    cur.execute("SELECT 1")
                _end_transaction(conn)
        except psycopg2.Error:
            _close(conn)
        if not conn.closed:
            _cache.conns[dsn] = (conn, time.monotonic())
            return conn
    conn = psycopg2.connect(dsn)
    _cache.conns[dsn] = (conn, time.monotonic())
    while len(_cache.conns) > MAX_CONNECTIONS_PER_THREAD:
        _, (old, _) = _cache.conns.popitem(last=False)
        _close(old)
    return conn


def _close(conn: Any) -> None:
    with contextlib.suppress(psycopg2.Error):
        conn.close()


def _forget(dsn: str) -> None:
    entry = _cache.conns.pop(dsn, None)
    if entry is not None:
        _close(entry[0])


def _adapt(value: Any) -> Any:
    return psycopg2.extras.Json(value) if isinstance(value, (dict, list)) else value


def _table_ident(table: str) -> sql.Composable:
    return sql.SQL(".").join(sql.Identifier(part) for part in table.split("."))


def _write_rows(cur: Any, table: str, rows: list[dict[str, Any]], mode: str, key: Any) -> int:
    """INSERT (or upsert) `rows` into `table`; returns the number of rows written."""
    columns: list[str] = []
    for row in rows:
        columns.extend(c for c in row if c not in columns)
    conflict = sql.SQL("")
    if mode == "upsert":
        keys = [k.strip() for k in key.split(",")] if isinstance(key, str) else [str(k) for k in key or []]
        if not keys:
            raise ValueError("postgres: mode upsert needs `key` (a column or a list of columns)")
        for k in keys:
            if any(k not in row for row in rows):
                raise ValueError(f"postgres: upsert key column {k!r} is missing from args")
        latest = {tuple(str(row[k]) for k in keys): row for row in rows}  # one row per key
        rows = list(latest.values())
        others = [c for c in columns if c not in keys]
        action = (
            sql.SQL("DO UPDATE SET {}").format(
                sql.SQL(", ").join(sql.SQL("{0} = EXCLUDED.{0}").format(sql.Identifier(c)) for c in others)
            )
            if others
            else sql.SQL("DO NOTHING")
        )
        conflict = sql.SQL(" ON CONFLICT ({}) {}").format(sql.SQL(", ").join(sql.Identifier(k) for k in keys), action)
    count = 0
    for start in range(0, len(rows), INSERT_CHUNK):
        chunk = rows[start : start + INSERT_CHUNK]
        values: list[Any] = []
        tuples = []
        for row in chunk:
            cells = []
            for column in columns:
                if column in row:
                    cells.append(sql.Placeholder())
                    values.append(_adapt(row[column]))
                else:
                    cells.append(sql.SQL("DEFAULT"))
            tuples.append(sql.SQL("({})").format(sql.SQL(", ").join(cells)))
        statement = sql.SQL("INSERT INTO {} ({}) VALUES {}{}").format(
            _table_ident(table),
            sql.SQL(", ").join(sql.Identifier(c) for c in columns),
            sql.SQL(", ").join(tuples),
            conflict,
        )
        cur.execute(statement, values)
        count += max(cur.rowcount, 0)
    return count


def _scrub(text: str, password: str | None) -> str:
    return text.replace(password, "***") if password else text


class PostgresSettings(ToolSettings):
    command: str | None = None
    query: str | None = None
    sql: str | None = None
    statement: str | None = None
    script: scripts.Script | None = None
    params: dict[str, Any] | list[Any] | None = None
    table: str | None = None
    mode: str | None = None
    key: str | list[str] | None = None
    args: dict[str, Any] | list[dict[str, Any]] | None = None
    database: str | None = None
    autocommit: bool | None = None
    credential: str | dict[str, Any] | None = None
    pool: dict[str, Any] | bool | None = None  # advisory: connections are cached per worker thread

    @field_validator("params")
    @classmethod
    def _params_fill_the_placeholders(cls, params: Any, info: ValidationInfo) -> Any:
        """The values of `params` match the text's `$N` placeholders (when the text is given
        literally; a template is checked once rendered)."""
        text = next((info.data.get(k) for k in _SQL_KEYS if isinstance(info.data.get(k), str)), None)
        if params is not None and text is not None and "{{" not in text and "{%" not in text:
            problem = positional_problem(text, params)
            if problem:
                raise ValueError(problem)
        return params


def positional_values(params: dict[str, Any] | list[Any]) -> list[Any]:
    """The values of `params` in `$1, $2, ...` order: a list as it is; a mapping by number when
    every key is one (`1`, `"2"`, `"$3"`), else its values in order."""
    if isinstance(params, list):
        return list(params)
    numbers = {}
    for key in params:
        digits = str(key).removeprefix("$")
        if not digits.isdigit():
            return list(params.values())
        numbers[int(digits)] = params[key]
    return [numbers.get(n) for n in range(1, max(numbers, default=0) + 1)]


def positional_problem(text: str, params: Any) -> str | None:
    """Why `params` cannot fill the `$N` placeholders of `text`, or None (also when the text has
    none: then `params` binds `%s` / `%(name)s`)."""
    numbers = [number for number, _, _ in placeholders(text)]
    if not numbers or not isinstance(params, (dict, list)):
        return None
    highest, given = max(numbers), len(positional_values(params))
    if 0 in numbers:
        return "the SQL has $0: positional parameters start at $1"
    keys = [str(key).removeprefix("$") for key in params] if isinstance(params, dict) else []
    if keys and all(key.isdigit() for key in keys):  # a mapping by number: each $N needs its key
        missing = sorted(set(numbers) - {int(key) for key in keys})
        if missing:
            return f"params gives no value for ${missing[0]} (its keys are numbers: each $N needs its own)"
    if given != highest:
        noun = "value" if given == 1 else "values"
        return f"the SQL's placeholders go up to ${highest} but params gives {given} {noun}"
    return None


def bind_positional(cur: Any, text: str, params: dict[str, Any] | list[Any], encoding: str) -> str:
    """`text` with each `$N` placeholder replaced by the quoted literal of its value."""
    values = positional_values(params)
    pieces, last = [], 0
    for number, start, stop in placeholders(text):
        value = values[number - 1]
        adapted = psycopg2.extras.Json(value) if isinstance(value, (dict, list)) else value
        pieces += [text[last:start], cur.mogrify("%s", [adapted]).decode(encoding)]
        last = stop
    return "".join(pieces) + text[last:]


@register(
    "postgres",
    settings=PostgresSettings,
    fields={
        "command",
        "query",
        "sql",
        "statement",
        "params",
        "table",
        "mode",
        "key",
        "args",
        "database",
        "autocommit",
        "script",
        "credential",
        "pool",
    },
    required=({"command", "query", "sql", "statement", "table", "script"},),
)
def run_postgres(call: ToolCall) -> Outcome:
    """Run the SQL text or the table write described by the call's config."""
    cfg = call.config
    text = next((cfg[k] for k in _SQL_KEYS if cfg.get(k)), None)
    if text is None and cfg.get("script") is not None:
        try:
            text = scripts.load(cfg["script"], call.source_file)
        except scripts.ScriptError as exc:
            return Outcome.fail(ToolErrorKind.SCRIPT, f"postgres: {exc}")
    table = cfg.get("table")
    if text is None and not table:
        return Outcome.fail(
            ToolErrorKind.INVALID_ARGS, "postgres: give `command` (or query/sql/statement) or `table` + `args`"
        )
    mode = str(cfg.get("mode") or "insert").lower()
    rows: list[dict[str, Any]] = []
    if text is None:
        if mode not in ("insert", "append", "upsert"):
            return Outcome.fail(
                ToolErrorKind.INVALID_ARGS, f"postgres: mode must be insert, append or upsert, not {mode!r}"
            )
        args = cfg.get("args")
        rows = [args] if isinstance(args, dict) else list(args) if isinstance(args, list) else []
        if not rows or not all(isinstance(r, dict) and r for r in rows):
            return Outcome.fail(
                ToolErrorKind.INVALID_ARGS, "postgres: table write needs `args`: a mapping of columns or a list of them"
            )
    try:
        dsn, password = build_dsn(call.credential, cfg.get("database"))
    except ValueError as exc:
        return Outcome.fail(ToolErrorKind.CREDENTIAL, str(exc))

    try:
        conn = _connection(dsn)
    except psycopg2.Error as exc:
        message = _scrub(str(exc).strip(), password)
        retryable = not any(hint in message for hint in _PERMANENT_CONNECT_ERRORS)
        return Outcome.fail(
            ToolErrorKind.CONNECTION,
            f"cannot connect to PostgreSQL: {message}",
            retryable,
            code=exc.pgcode,
            pg={"code": exc.pgcode},
        )

    if text is None:
        return _write_table(conn, dsn, password, call.timeout, str(table), rows, mode, cfg.get("key"))
    return _run_text(conn, dsn, password, call.timeout, text, cfg.get("params"))


def _write_table(
    conn: Any,
    dsn: str,
    password: str | None,
    timeout: float | None,
    table: str,
    rows: list[dict[str, Any]],
    mode: str,
    key: Any,
) -> Outcome:
    """The table write, all its rows in one transaction."""
    try:
        conn.autocommit = False
        with conn.cursor() as cur:
            _set_timeout(cur, timeout)
            count = _write_rows(cur, table, rows, mode, key)
        conn.commit()
        return Outcome.ok({"row_count": count, "table": table, "mode": mode})
    except ValueError as exc:
        _end_open_transaction(conn, dsn)
        return Outcome.fail(ToolErrorKind.INVALID_ARGS, str(exc))
    except psycopg2.Error as exc:
        _end_open_transaction(conn, dsn)
        return _sql_failure(exc, conn, dsn, password)


def _run_text(conn: Any, dsn: str, password: str | None, timeout: float | None, text: str, params: Any) -> Outcome:
    """Run the statements of `text` one by one, each committed on its own unless the text opens a
    transaction (BEGIN ... COMMIT), as psql runs a script; the result is the last statement's."""
    done, statements = 0, []
    try:
        conn.autocommit = True
        with conn.cursor() as cur:
            if params is not None:  # bound once over the whole text, then split
                text = _bind(cur, text, params, psycopg2.extensions.encodings[conn.encoding])
            statements = split_statements(text)
            if not statements:
                return Outcome.fail(ToolErrorKind.INVALID_ARGS, "postgres: the SQL text holds no statement")
            _set_timeout(cur, timeout)
            results = []
            for statement in statements:
                cur.execute(statement)
                done += 1
                results.append(_statement_result(cur))
            data = sql_result.stored(results)
        if conn.get_transaction_status() != psycopg2.extensions.TRANSACTION_STATUS_IDLE:
            _end_open_transaction(conn, dsn)
            return Outcome.fail(
                ToolErrorKind.INVALID_ARGS,
                "postgres: the SQL text ends inside a transaction (BEGIN without COMMIT); it was rolled back",
            )
        return Outcome.ok(data)
    except ValueError as exc:
        _end_open_transaction(conn, dsn)
        return Outcome.fail(ToolErrorKind.INVALID_ARGS, str(exc))
    except psycopg2.Error as exc:
        _end_open_transaction(conn, dsn)
        where = f"statement {done + 1} of {len(statements)}" if done or len(statements) > 1 else ""
        return _sql_failure(exc, conn, dsn, password, where)


def _bind(cur: Any, text: str, params: Any, encoding: str) -> str:
    """The text with `params` bound: to its `$N` placeholders when it has some, else by psycopg2
    (`%s` / `%(name)s`; a mapping value binds as JSON, a list stays an ARRAY)."""
    if not isinstance(params, (dict, list)):
        raise ValueError(f"postgres: params must be a list or a mapping, not {type(params).__name__}")
    if placeholders(text):
        problem = positional_problem(text, params)
        if problem:
            raise ValueError(f"postgres: {problem}")
        return bind_positional(cur, text, params, encoding)
    if isinstance(params, dict):
        params = {k: psycopg2.extras.Json(v) if isinstance(v, dict) else v for k, v in params.items()}
    return str(cur.mogrify(text, params).decode(encoding))


def _statement_result(cur: Any) -> dict[str, Any]:
    """One statement's fields: its rows, row count, columns and status message (and, for a
    statement without rows, `affected_rows`, as NoETL's Rust tool names it)."""
    columns = [d.name for d in cur.description] if cur.description else []
    fetched = cur.fetchall() if cur.description else []
    result = {
        "rows": [to_jsonable(dict(zip(columns, row, strict=True))) for row in fetched],
        "row_count": cur.rowcount,
        "columns": columns,
        "statusmessage": cur.statusmessage,
    }
    if cur.description is None:
        result["affected_rows"] = max(cur.rowcount, 0)
    return result


def _set_timeout(cur: Any, timeout: float | None) -> None:
    """The session's statement_timeout for this call (each statement of a text, or the table
    write); without a timeout, the connection's default again."""
    if timeout:
        cur.execute("SET statement_timeout = %s", [int(timeout * 1000)])
    else:
        cur.execute("RESET statement_timeout")


def _sql_failure(exc: psycopg2.Error, conn: Any, dsn: str, password: str | None, where: str = "") -> Outcome:
    message = _scrub((exc.pgerror or str(exc)).strip(), password)
    if where:
        message = f"{where}: {message}"
    code = exc.pgcode
    if isinstance(exc, (psycopg2.OperationalError, psycopg2.InterfaceError)) and (conn.closed or code is None):
        _forget(dsn)
        return Outcome.fail(
            ToolErrorKind.CONNECTION, f"PostgreSQL connection failed: {message}", True, code=code, pg={"code": code}
        )
    return Outcome.fail(ToolErrorKind.SQL_ERROR, message, code in RETRYABLE_SQLSTATES, code=code, pg={"code": code})


def _end_open_transaction(conn: Any, dsn: str) -> None:
    """Roll back the transaction a call opened and left open or failed in (forget a broken connection)."""
    try:
        _end_transaction(conn)
    except psycopg2.Error:
        _forget(dsn)


def _end_transaction(conn: Any) -> None:
    if conn.closed or conn.get_transaction_status() == psycopg2.extensions.TRANSACTION_STATUS_IDLE:
        return
    if conn.autocommit:  # psycopg2 did not open it, so its rollback() would not end it
        with conn.cursor() as cur:
            cur.execute("ROLLBACK")
    else:
        conn.rollback()
