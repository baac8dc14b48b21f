"""The `duckdb` tool: run SQL on an embedded DuckDB database, with PostgreSQL attached on request.

Config (rendered): `query` (aliases command, commands, sql, statement) — one text, run as one
`execute` (several statements run in order; the result is the last one's); `params` (a list for
`?`/`$1`, a mapping for `$name`); `database`: a file path (relative paths are under
NOETL_DUCKDB_DIR), or `:memory:`; without it each execution gets its own file
`<NOETL_DUCKDB_DIR>/<store>/execution_<id>.duckdb` (store: a digest of the event store's URL,
as execution ids are unique only within one store), so the steps of one execution share their
tables. Files are kept after the execution ends (remove them with the execution's data).
`attach: {alias: credential}` attaches a PostgreSQL database (the credential is resolved like
`auth:`) as `alias` before the query runs (`ATTACH ... (TYPE postgres)`, read-write).
`auth:` is NoETL's form: `{alias: credential-ref}` creates a DuckDB secret `alias` per PostgreSQL
credential (the SQL attaches it: `ATTACH '' AS alias (TYPE postgres, SECRET alias)`); a single
credential ref creates the default postgres secret (`ATTACH '' AS db (TYPE postgres)`).
The postgres extension is loaded when the call attaches or its SQL mentions postgres: from
DuckDB's extension directory, else from the duckdb-ext-postgres wheel (installed into that
directory, so the SQL's own `INSTALL postgres` needs no network), else downloaded.

Data, shaped like the postgres tool's one-statement result (sql_result.py): {status: success,
rows: [{column: value}], row_count, columns, statement_count: 1, database}, the last statement's
rows stored once; templates also read it as `command_0`. A connection is opened per call and closed after it
(DuckDB lets one process write a file at a time). Errors: kind "sql_error" (the DuckDB message)
or "extension" when PostgreSQL cannot be attached. Passwords of attached credentials never
appear in the outcome (they are handed to the worker's masking).
"""

from __future__ import annotations

import contextlib
import re
import sysconfig
from pathlib import Path
from typing import Any

import psycopg2.extensions

from noetl_celery.config import credentials
from noetl_celery.config import settings as noetl_settings
from noetl_celery.core import sql_result
from noetl_celery.core.errors import CredentialError
from noetl_celery.core.jsonable import to_jsonable
from noetl_celery.core.vocabulary import ToolErrorKind
from noetl_celery.tools.base import SECRET_VALUES_META, Outcome, ToolCall, register
from noetl_celery.tools.postgres import build_dsn
from noetl_celery.tools.settings import ToolSettings

DIR_ENV = noetl_settings.DUCKDB_DIR_ENV
DEFAULT_DIR = noetl_settings.DEFAULT_DUCKDB_DIR
MEMORY = ":memory:"
_SQL_KEYS = ("query", "command", "commands", "sql", "statement")
_MENTIONS_POSTGRES = re.compile(r"\bpostgres\b", re.IGNORECASE)
# Where a pip-installed DuckDB extension package (duckdb-ext-postgres, ...) puts the extension file.
_BUNDLED_EXTENSION = "duckdb_ext/extensions/v{version}/{platform}/{file}.duckdb_extension"


class DuckdbSettings(ToolSettings):
    query: str | None = None
    command: str | None = None
    commands: str | None = None
    sql: str | None = None
    statement: str | None = None
    params: list[Any] | dict[str, Any] | None = None
    database: str | None = None
    attach: dict[str, str | dict[str, Any]] | None = None
    auth: str | dict[str, Any] | None = None


def database_path(database: str | None, execution_id: int | None, store_key: str | None = None) -> str:
    """The database the call opens: `:memory:`, the named file, or the execution's own file."""
    if database == MEMORY:
        return MEMORY
    base = noetl_settings.load().duckdb_dir
    if database:
        path = Path(database).expanduser()
        path = path if path.is_absolute() else base / path
    else:
        name = f"execution_{execution_id if execution_id is not None else 'none'}.duckdb"
        path = base / (store_key or "local") / name
    path.parent.mkdir(parents=True, exist_ok=True)
    return str(path)


def load_extension(conn: Any, duckdb: Any, name: str, file_stem: str | None = None) -> None:
    """LOAD extension `name`: installed in DuckDB's home, shipped by a pip package (duckdb-ext-<name>,
    file `<file_stem>.duckdb_extension`), or installed now."""
    try:
        conn.execute(f"LOAD {name}")
        return
    except duckdb.Error:
        pass
    platform = conn.execute("PRAGMA platform").fetchone()[0]
    bundled = Path(sysconfig.get_paths()["purelib"]) / _BUNDLED_EXTENSION.format(
        version=duckdb.__version__, platform=platform, file=file_stem or name
    )
    try:
        conn.execute(f"INSTALL {quote(str(bundled))}" if bundled.is_file() else f"INSTALL {name}")
        conn.execute(f"LOAD {name}")
    except duckdb.Error as exc:
        raise AttachError(
            f"the DuckDB {name} extension is not available on this worker (install the package "
            f"duckdb-ext-{name} matching duckdb {duckdb.__version__}): {exc}"
        ) from None


def _load_postgres_extension(conn: Any, duckdb: Any) -> None:
    load_extension(conn, duckdb, "postgres", "postgres_scanner")


class AttachError(Exception):
    pass


def quote(text: str) -> str:
    return "'" + text.replace("'", "''") + "'"


def postgres_credential(alias: str, ref: Any, secrets: set[str]) -> dict[str, str]:
    """The libpq parameters of the credential `ref` names (its secrets go to `secrets`)."""
    try:
        credential = credentials.resolve(ref)
    except CredentialError as exc:
        raise AttachError(f"{alias}: {exc}") from None
    secrets |= credentials.secret_values(credential)
    try:
        dsn, password = build_dsn(credential)
    except ValueError as exc:
        raise AttachError(f"{alias}: {exc}") from None
    if password:
        secrets.add(password)
    return {"dsn": dsn, **psycopg2.extensions.parse_dsn(dsn)}


def _attach(conn: Any, attach: dict[str, Any], secrets: set[str]) -> None:
    for alias, ref in attach.items():
        if not str(alias).isidentifier():
            raise AttachError(f"attach alias {alias!r} must be a plain name")
        params = postgres_credential(f"attach {alias}", ref, secrets)
        conn.execute(f"ATTACH {quote(params['dsn'])} AS {alias} (TYPE postgres)")


_REF_KEYS = frozenset({"type", "credential", "key", "name", "source", "dsn", "url", "host", "user", "password"})
_SECRET_PARAMS = {"host": "HOST", "port": "PORT", "dbname": "DATABASE", "user": "USER", "password": "PASSWORD"}


def _auth_secrets(conn: Any, auth: Any, secrets: set[str]) -> None:
    """NoETL's `auth:` on duckdb: one DuckDB secret per alias (or the default one for a single ref)."""
    single = (
        isinstance(auth, str)
        or bool(_REF_KEYS & set(auth))
        or not all(isinstance(v, (str, dict)) for v in auth.values())
    )
    named = {None: auth} if single else dict(auth)
    for alias, ref in named.items():
        if alias is not None and not str(alias).isidentifier():
            raise AttachError(f"auth alias {alias!r} must be a plain name")
        params = postgres_credential(f"auth {alias or ''}".strip(), ref, secrets)
        options = ", ".join(
            f"{key} {quote(str(params[name]))}" for name, key in _SECRET_PARAMS.items() if params.get(name)
        )
        conn.execute(f"CREATE OR REPLACE TEMPORARY SECRET {alias or ''} (TYPE postgres, {options})")


@register(
    "duckdb",
    fields={*_SQL_KEYS, "params", "database", "attach"},
    required=(set(_SQL_KEYS),),
    settings=DuckdbSettings,
    resolves_auth=True,
    extra="duckdb",
    modules=("duckdb",),
)
def run_duckdb(call: ToolCall) -> Outcome:
    """Run the call's SQL on its database and return the rows of the last statement."""
    import duckdb  # imported here: a worker without duckdb still runs every other tool

    cfg = call.config
    text = next((cfg[k] for k in _SQL_KEYS if cfg.get(k)), None)
    if not isinstance(text, str):
        return Outcome.fail(ToolErrorKind.INVALID_ARGS, "duckdb: give `query` (or command/commands/sql/statement)")
    secrets: set[str] = set()
    outcome = _run(duckdb, call, text, secrets)
    if secrets:
        outcome.meta[SECRET_VALUES_META] = sorted(secrets)
    return outcome


def _run(duckdb: Any, call: ToolCall, text: str, secrets: set[str]) -> Outcome:
    path = database_path(call.config.get("database"), call.execution_id, call.store_key)
    try:
        conn = duckdb.connect(path)
    except duckdb.Error as exc:
        return Outcome.fail(ToolErrorKind.CONNECTION, f"duckdb: cannot open {path}: {exc}", True)
    try:
        attach, auth = call.config.get("attach") or {}, call.config.get("auth")
        if attach or auth:
            _load_postgres_extension(conn, duckdb)
        elif _MENTIONS_POSTGRES.search(text):  # the SQL may INSTALL/LOAD it itself: have it at hand
            with contextlib.suppress(AttachError):
                _load_postgres_extension(conn, duckdb)
        if auth:
            _auth_secrets(conn, auth, secrets)
        _attach(conn, attach, secrets)
        params = call.config.get("params")
        cursor = conn.execute(text, params) if params is not None else conn.execute(text)
        columns = [d[0] for d in cursor.description] if cursor.description else []
        fetched = cursor.fetchall() if cursor.description else []
        rows = [to_jsonable(dict(zip(columns, row, strict=True))) for row in fetched]
        result = sql_result.stored([{"rows": rows, "row_count": len(rows), "columns": columns}])
        return Outcome.ok({**result, "database": path})
    except AttachError as exc:
        return Outcome.fail(ToolErrorKind.EXTENSION if "extension" in str(exc) else "credential", f"duckdb: {exc}")
    except duckdb.Error as exc:
        return Outcome.fail(ToolErrorKind.SQL_ERROR, f"duckdb: {type(exc).__name__}: {exc}")
    finally:
        conn.close()
