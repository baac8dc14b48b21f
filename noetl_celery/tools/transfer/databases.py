"""Database endpoints of `transfer`: PostgreSQL (psycopg2), MySQL/MariaDB (PyMySQL), DuckDB,
SQLite and Snowflake (snowflake-connector-python, the snowflake tool's connection), as a source
read in chunks through a streaming cursor and as a target written a chunk per statement batch.

Decides: how each database is connected to (the side's `connection`/`dsn`, else its resolved
`auth`, else the task's), how rows are read without holding the result (PostgreSQL: a named,
server-side cursor; MySQL: an unbuffered SSCursor; DuckDB/SQLite/Snowflake: fetchmany), and the
SQL each mode writes: append/insert a plain INSERT, upsert INSERT ... ON CONFLICT (key) DO UPDATE
(PostgreSQL, SQLite, DuckDB), ON DUPLICATE KEY UPDATE (MySQL) or one MERGE per chunk
(Snowflake, where plain names stay unquoted: quoting would make them case-sensitive), replace the table emptied
first (TRUNCATE on PostgreSQL, DELETE elsewhere). append/insert/upsert commit each chunk;
replace is one transaction (the table shows the old rows or all the new ones). A custom
`target.query` runs once per row with the row's values in column order.
Connections are opened per call and closed after it; nothing here logs.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import decimal
import json
import re
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any
from urllib.parse import unquote, urlsplit

from noetl_celery.tools.transfer.plan import Endpoint, PlanError, TransferPlan
from noetl_celery.tools.transfer.rows import Chunk, Row

MYSQL_PORT = 3306
_PLAIN = (type(None), str, int, float, bool)


@dataclass
class Where:
    """What a database endpoint needs besides its settings: its credential and the call's ids
    (DuckDB's per-execution file)."""

    credential: Any
    execution_id: int | None
    store_key: str | None
    secrets: set[str]
    timeout: float | None = None  # the attempt's: each statement (PostgreSQL) and read/write (MySQL) is bounded by it


# ---------------------------------------------------------------------------------------------
# connections


def connect(endpoint: Endpoint, where: Where) -> Any:
    """An open DB-API connection for the endpoint (autocommit off)."""
    kind = endpoint.type
    if kind == "postgres":
        return _connect_postgres(endpoint, where)
    if kind == "mysql":
        return _connect_mysql(endpoint, where)
    if kind == "snowflake":
        return _connect_snowflake(endpoint, where)
    if kind == "duckdb":
        import duckdb

        from noetl_celery.tools.duckdb import database_path

        return duckdb.connect(database_path(endpoint.text("database", "path"), where.execution_id, where.store_key))
    import sqlite3

    file = endpoint.text("database", "path", "file")
    if not file:
        raise PlanError(f"{endpoint.side}.database is required for sqlite (a file path, or :memory:)")
    return sqlite3.connect(file)


def _credential(endpoint: Endpoint, where: Where) -> Any:
    inline = endpoint.get("connection", "dsn", "connection_string")
    if inline is not None:
        where.secrets.add(str(inline))
        return inline
    return where.credential


def _connect_postgres(endpoint: Endpoint, where: Where) -> Any:
    import psycopg2
    import psycopg2.extensions

    from noetl_celery.tools.postgres import build_dsn

    dsn, password = build_dsn(_credential(endpoint, where), endpoint.text("database", "dbname"))
    if password:
        where.secrets.add(password)
    if where.timeout:
        return psycopg2.connect(dsn, options=f"-c statement_timeout={int(where.timeout * 1000)}")
    return psycopg2.connect(dsn)


def mysql_args(credential: Any, side: str) -> dict[str, Any]:
    """PyMySQL connect() arguments from a mysql:// URL or a mapping {host, port, user, password, database}."""
    value = credential
    if isinstance(value, dict):
        value = next((value[k] for k in ("url", "dsn", "uri", "connection") if value.get(k)), None) or value
    if isinstance(value, str):
        parts = urlsplit(value)
        if parts.scheme not in ("mysql", "mariadb", "mysql+pymysql") or not parts.hostname:
            raise PlanError(f"{side}: a mysql credential string must be a mysql://user:password@host:port/db URL")
        args: dict[str, Any] = {"host": parts.hostname, "port": parts.port or MYSQL_PORT}
        for key, raw in (("user", parts.username), ("password", parts.password), ("database", parts.path.strip("/"))):
            if raw:
                args[key] = unquote(raw)
        return args
    if isinstance(value, dict) and (value.get("host") or value.get("unix_socket")):
        args = {k: value[k] for k in ("host", "unix_socket") if value.get(k)}
        args["port"] = int(value.get("port") or MYSQL_PORT)
        for key, names in (("user", ("user", "username")), ("database", ("database", "db", "dbname"))):
            found = next((value[n] for n in names if value.get(n)), None)
            if found is not None:
                args[key] = str(found)
        if value.get("password") is not None:
            args["password"] = str(value["password"])
        return args
    raise PlanError(f"{side}: a mysql endpoint needs `auth` (or `connection`): a mysql:// URL or {{host, user, ...}}")


def _connect_mysql(endpoint: Endpoint, where: Where) -> Any:
    import pymysql

    args = mysql_args(_credential(endpoint, where), endpoint.side)
    if args.get("password"):
        where.secrets.add(args["password"])
    database = endpoint.text("database", "db")
    if database:
        args["database"] = database
    if where.timeout:
        args["read_timeout"] = args["write_timeout"] = max(1, int(where.timeout))
    return pymysql.connect(**args, autocommit=False, charset="utf8mb4", ssl_disabled=not endpoint.get("ssl"))


SNOWFLAKE_PREFIX = "sf_"  # NoETL's snowflake credentials may spell their keys sf_account, sf_user, ...


def _connect_snowflake(endpoint: Endpoint, where: Where) -> Any:
    """The snowflake tool's connection parameters: the credential's keys (NoETL's `sf_` prefix
    accepted), then the endpoint's own `account`, `warehouse`, `database`, `schema`, `role`."""
    import snowflake.connector

    from noetl_celery.tools.snowflake import connection_parameters

    credential = _credential(endpoint, where)
    if isinstance(credential, dict):
        credential = {k.removeprefix(SNOWFLAKE_PREFIX): v for k, v in credential.items()}
    try:
        parameters = connection_parameters(endpoint.settings, credential)
    except ValueError as exc:
        raise PlanError(f"{endpoint.side}: {exc}") from None
    for key in ("password", "private_key_passphrase"):
        if parameters.get(key):
            where.secrets.add(str(parameters[key]))
    if isinstance(credential, dict) and credential.get("private_key"):
        where.secrets.add(str(credential["private_key"]))
    if where.timeout:
        parameters["network_timeout"] = max(1, int(where.timeout))
    return snowflake.connector.connect(**parameters, autocommit=False)


# ---------------------------------------------------------------------------------------------
# reading


def read_chunks(conn: Any, endpoint: Endpoint, size: int) -> Iterator[Chunk]:
    """The source query's rows, `size` at a time, read through a streaming cursor."""
    query = endpoint.text("query", "sql", "command")
    if query is None:
        query = f"SELECT * FROM {quote_table(endpoint.type, endpoint.text('table') or '')}"
    params = endpoint.get("params")
    cursor = _streaming_cursor(conn, endpoint.type, size)
    try:
        if params is None:
            cursor.execute(query)
        else:
            cursor.execute(query, params)
        while True:
            rows = cursor.fetchmany(size)
            if not rows:
                return
            columns = [d[0] for d in cursor.description]
            if endpoint.type == "snowflake":  # Snowflake's upper-case names, lowered as NoETL does
                columns = [c.lower() for c in columns]
            yield Chunk(columns, [tuple(r) for r in rows])
    finally:
        with contextlib.suppress(Exception):
            cursor.close()


def _streaming_cursor(conn: Any, kind: str, size: int) -> Any:
    if kind == "postgres":
        cursor = conn.cursor(name="noetl_transfer_source")  # server-side: rows stay on the server
        cursor.itersize = size
        return cursor
    if kind == "mysql":
        import pymysql.cursors

        return conn.cursor(pymysql.cursors.SSCursor)  # unbuffered: rows are read as fetched
    return conn.cursor()


# ---------------------------------------------------------------------------------------------
# writing


class TableWriter:
    """Writes chunks into `target.table` (or through `target.query`) in the plan's mode."""

    def __init__(self, conn: Any, plan: TransferPlan) -> None:
        self.conn = conn
        self.kind = plan.target.type
        self.plan = plan
        self.table = plan.target.text("table")
        self.custom = plan.target.text("query", "sql")
        self.statement: str | None = None
        self.key_positions: list[int] = []
        self.one_transaction = plan.mode == "replace"

    def start(self) -> None:
        """Open the first transaction; empty the table for mode replace (in the transaction that
        writes the rows)."""
        self._begin()
        if self.plan.mode == "replace" and self.table:
            word = "TRUNCATE TABLE" if self.kind == "postgres" else "DELETE FROM"
            with contextlib.closing(self.conn.cursor()) as cur:
                cur.execute(f"{word} {quote_table(self.kind, self.table)}")

    def write(self, chunk: Chunk) -> int:
        if self.statement is None:
            self.statement = self.custom or self._insert(chunk.columns)
        rows = [self._adapt(row) for row in chunk.rows]
        if self.plan.mode == "upsert":
            rows = list({tuple(str(row[i]) for i in self.key_positions): row for row in rows}.values())
        with contextlib.closing(self.conn.cursor()) as cur:
            self._execute(cur, rows)
        if not self.one_transaction:
            self.conn.commit()
            self._begin()
        return len(chunk.rows)

    def finish(self) -> None:
        self.conn.commit()

    def _begin(self) -> None:
        if self.kind == "duckdb":  # DuckDB autocommits each statement unless a transaction is open
            self.conn.begin()

    def _insert(self, columns: list[str]) -> str:
        kind, names = self.kind, [quote(self.kind, c) for c in columns]
        values = "%s" if kind == "postgres" else "(" + ", ".join([_placeholder(kind)] * len(columns)) + ")"
        text = f"INSERT INTO {quote_table(kind, self.table or '')} ({', '.join(names)}) VALUES {values}"
        if self.plan.mode != "upsert":
            return text
        key = self.plan.key or columns[:1]
        missing = [k for k in key if k not in columns]
        if missing:
            raise PlanError(
                f"upsert key column {missing[0]!r} is not among the columns written ({', '.join(columns)}); "
                "set `key` to the target's unique column(s)"
            )
        self.key_positions = [columns.index(k) for k in key]
        others = [quote(kind, c) for c in columns if c not in key]
        if kind == "snowflake":
            return _merge(self.table or "", columns, key)
        if kind == "mysql":
            updates = ", ".join(f"{c} = VALUES({c})" for c in others) or f"{names[0]} = {names[0]}"
            return f"{text} ON DUPLICATE KEY UPDATE {updates}"
        conflict = ", ".join(quote(kind, k) for k in key)
        action = "DO UPDATE SET " + ", ".join(f"{c} = EXCLUDED.{c}" for c in others) if others else "DO NOTHING"
        return f"{text} ON CONFLICT ({conflict}) {action}"

    def _execute(self, cur: Any, rows: list[Row]) -> None:
        if self.kind == "postgres":
            import psycopg2.extras

            if self.custom:
                psycopg2.extras.execute_batch(cur, self.statement, rows, page_size=200)
            else:
                psycopg2.extras.execute_values(cur, self.statement, rows, page_size=len(rows) or 1)
        elif self.kind == "snowflake" and self.plan.mode == "upsert" and not self.custom:
            if rows:  # one MERGE per chunk, its rows in the USING (VALUES ...) list
                cur.execute(_merge_rows(str(self.statement), len(rows), len(rows[0])), [v for row in rows for v in row])
        elif self.kind == "duckdb" and not self.custom:
            for start in range(0, len(rows), DUCKDB_ROWS_PER_STATEMENT):
                part = rows[start : start + DUCKDB_ROWS_PER_STATEMENT]
                cur.execute(_multi_row(str(self.statement), len(part)), [v for row in part for v in row])
        else:
            cur.executemany(self.statement, rows)

    def _adapt(self, row: Row) -> Row:
        if all(type(v) in _PLAIN for v in row):
            return row
        return tuple(adapt(self.kind, v) for v in row)


DUCKDB_ROWS_PER_STATEMENT = 500  # DuckDB's executemany runs a statement per row: batch them in one


def _multi_row(statement: str, count: int) -> str:
    """`INSERT ... VALUES (?, ?)` with `count` row tuples (the conflict clause kept after them)."""
    head, _, rest = statement.partition(" VALUES ")
    group, _, tail = rest.partition(")")
    return f"{head} VALUES {', '.join([group + ')'] * count)}{tail}"


MERGE_ROWS_MARK = "{rows}"


def _merge(table: str, columns: list[str], key: list[str]) -> str:
    """Snowflake's upsert: MERGE INTO the table USING the chunk's rows (a VALUES list whose
    row groups _merge_rows fills in) ON the key, updating the other columns of a matched row."""
    names = [quote("snowflake", c) for c in columns]
    on = " AND ".join(f"t.{quote('snowflake', k)} = s.{quote('snowflake', k)}" for k in key)
    others = [quote("snowflake", c) for c in columns if c not in key]
    update = f" WHEN MATCHED THEN UPDATE SET {', '.join(f't.{c} = s.{c}' for c in others)}" if others else ""
    return (
        f"MERGE INTO {quote_table('snowflake', table)} AS t USING (SELECT * FROM VALUES {MERGE_ROWS_MARK}) "
        f"AS s ({', '.join(names)}) ON {on}{update} WHEN NOT MATCHED THEN INSERT ({', '.join(names)}) "
        f"VALUES ({', '.join('s.' + n for n in names)})"
    )


def _merge_rows(statement: str, count: int, width: int) -> str:
    group = "(" + ", ".join(["%s"] * width) + ")"
    return statement.replace(MERGE_ROWS_MARK, ", ".join([group] * count), 1)


def adapt(kind: str, value: Any) -> Any:
    """A value the target's driver can bind: JSON text for objects and lists (psycopg2's Json),
    text for UUIDs, and for SQLite, text for decimals and dates."""
    if isinstance(value, (dict, list)):
        if kind == "postgres":
            import psycopg2.extras

            return psycopg2.extras.Json(value)
        return json.dumps(value, default=str)
    if isinstance(value, uuid.UUID):
        return str(value)
    if kind == "sqlite" and isinstance(value, (decimal.Decimal, dt.date, dt.time)):
        return value.isoformat() if not isinstance(value, decimal.Decimal) else str(value)
    return value


def _placeholder(kind: str) -> str:
    return "%s" if kind in ("postgres", "mysql", "snowflake") else "?"


SNOWFLAKE_PLAIN_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_$]*$")


def quote(kind: str, name: str) -> str:
    """The identifier quoted for the database; on Snowflake a plain name stays unquoted (quoting
    would make it case-sensitive, and Snowflake stores unquoted names upper-case)."""
    if kind == "snowflake" and SNOWFLAKE_PLAIN_NAME.match(name):
        return name
    mark = "`" if kind == "mysql" else '"'
    return mark + name.replace(mark, mark * 2) + mark


def quote_table(kind: str, table: str) -> str:
    """`schema.table` quoted part by part (a name is never pasted into SQL as it is)."""
    parts = [p.strip().strip('"`') for p in table.split(".")]
    if not table or not all(parts):
        raise PlanError(f"table name {table!r} must be `table` or `schema.table`")
    return ".".join(quote(kind, p) for p in parts)
