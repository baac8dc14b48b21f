"""The mysql cursor driver: a work table on MariaDB 10.6+ or MySQL 8+, a frame of rows per claim, PyMySQL.

No claim SQL: the driver owns the claim, so that its lease and dead-letter rules are the same for
every playbook. The table needs, besides its own columns, the queue columns (names changeable
with `columns:`):

    id          the row's key (`id_column`, default `id`)
    status      VARCHAR: 'pending' -> 'claimed' -> 'done' | 'dead'
    claimed_by  VARCHAR(255) NULL: the slot (`__worker_slot_id`) holding the row
    claimed_at  DATETIME(6) NULL: when it was claimed (the server's clock)
    attempts    INT NOT NULL DEFAULT 0: how many times the row was claimed

Cursor keys: `table` (required, `name` or `database.name`), `id_column`, `where` (an SQL filter
ANDed to the claim's, e.g. `batch = 7`), `order_by` (default the id column), `max_deliveries`
(default 5), `reclaim_seconds`, `wait_seconds` (default 0), `columns` ({status, claimed_by,
claimed_at, attempts} -> the table's names), `done_status` ('done'), `dead_status` ('dead').
`auth:` names a `mysql://user:password@host:port/db` URL or a mapping {host, port, user,
password, database} (or `url`/`dsn`).

A claim is one transaction at READ COMMITTED:
1. The rows of the slot's previous claim (`call.done`, their chains over) get `done_status`,
   guarded by `claimed_by` = this slot (a row taken over by another slot is not theirs to close).
2. `SELECT ... LIMIT n FOR UPDATE SKIP LOCKED` up to n rows (the frame's `max_rows`, default 1:
   `call.max_rows`) that are 'pending', or 'claimed' by this
   slot (its claim committed, then its worker died before the engine recorded the claim: the
   redelivered claim takes it back), or 'claimed' by anyone longer ago than `reclaim_seconds`
   (default 2 x the frame's `lease_seconds` + 30 s, see cursors.RECLAIM_MARGIN): a stale claim,
   whose slot is gone. A row's chain must end well within it, since the row is handed out again.
3. A row already claimed `max_deliveries` times is a poison row: it gets `dead_status` (the dead
   letter: it stays in the table, out of every claim; set it back to 'pending' with attempts 0 to
   try it again) and the claim looks further. Otherwise the row gets 'claimed', this slot,
   NOW(6) and attempts + 1, and is returned with all its columns (the rows in `order_by` order).
Nothing found: zero rows, the slot is over (an empty queue at the moment of the claim ends the
slot unless `wait_seconds` keeps it polling that long for a row).

The connection is kept per thread and checked alive (a ping) before each claim; a forked child
(a prefork pool process) drops its parent's connections and opens its own.

PyMySQL rather than mysqlclient: pure Python (no libmysqlclient headers or compiler to install),
maintained by the PyMySQL project, and the claim's one small statement per step gains nothing
from a C driver.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import decimal
import os
import re
import threading
import time
from typing import Any
from urllib.parse import unquote, urlsplit

from noetl_celery.core.vocabulary import ToolErrorKind
from noetl_celery.cursors import SLOT_PARAM, ClaimCall, reclaim_seconds, register, wait_seconds
from noetl_celery.tools.base import Outcome

DEFAULT_MAX_DELIVERIES = 5
CONNECT_TIMEOUT = 10  # seconds
POLL_INTERVAL = 0.5  # seconds between claims while `wait_seconds` keeps an empty claim waiting
KEYS = frozenset(
    {
        "table",
        "id_column",
        "where",
        "order_by",
        "max_deliveries",
        "columns",
        "done_status",
        "dead_status",
        "wait_seconds",
        "reclaim_seconds",
    }
)
QUEUE_COLUMNS = ("status", "claimed_by", "claimed_at", "attempts")
_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_$]*$")
# MySQL error codes a claim may simply run again: lock wait timeout, deadlock, server gone
_RETRYABLE = frozenset({1205, 1213, 2003, 2006, 2013})


class _Bad(ValueError):
    pass


def _ident(name: Any, what: str) -> str:
    parts = str(name).split(".") if isinstance(name, str) else []
    if not parts or len(parts) > 2 or not all(_NAME.match(p) for p in parts):
        raise _Bad(f"mysql cursor: {what} must be a plain name (letters, digits, _), not {name!r}")
    return ".".join(f"`{p}`" for p in parts)


def connect_args(credential: Any) -> dict[str, Any]:
    """PyMySQL connect() arguments from a mysql:// URL or a mapping."""
    value = credential
    if isinstance(credential, dict):
        value = next((credential[k] for k in ("url", "dsn", "uri") if credential.get(k)), None) or credential
    if isinstance(value, str):
        parts = urlsplit(value)
        if parts.scheme not in ("mysql", "mariadb", "mysql+pymysql") or not parts.hostname:
            raise _Bad("mysql cursor needs `auth:` naming a mysql://user:password@host:port/database URL or a mapping")
        args: dict[str, Any] = {"host": parts.hostname, "port": parts.port or 3306}
        if parts.username:
            args["user"] = unquote(parts.username)
        if parts.password:
            args["password"] = unquote(parts.password)
        if parts.path.strip("/"):
            args["database"] = unquote(parts.path.strip("/"))
        return args
    if isinstance(value, dict):
        if not value.get("host") and not value.get("unix_socket"):
            raise _Bad("mysql cursor: the credential mapping needs `host` (or `unix_socket`, or `url`)")
        args = {k: value[k] for k in ("host", "unix_socket", "database") if value.get(k)}
        args["port"] = int(value.get("port") or 3306)
        user = value.get("user") or value.get("username")
        if user:
            args["user"] = str(user)
        if value.get("password") is not None:
            args["password"] = str(value["password"])
        if value.get("db") and "database" not in args:
            args["database"] = str(value["db"])
        return args
    raise _Bad("mysql cursor needs `auth:` naming a mysql:// URL or a mapping with host, user, password, database")


def _plain(value: Any) -> Any:
    if isinstance(value, (dt.datetime, dt.date, dt.time)):
        return value.isoformat()
    if isinstance(value, dt.timedelta):
        return value.total_seconds()
    if isinstance(value, decimal.Decimal):
        return int(value) if value == value.to_integral_value() else float(value)
    if isinstance(value, (bytes, bytearray)):
        return bytes(value).decode("utf-8", errors="replace")
    return value


class _Claim:
    """The SQL of one cursor's claim, its names checked and quoted once."""

    def __init__(self, opts: dict[str, Any]) -> None:
        if not opts.get("table"):
            raise _Bad("mysql cursor needs `table:` (the work table)")
        self.table = _ident(opts["table"], "table")
        self.id_name = str(opts.get("id_column") or "id")
        self.id = _ident(self.id_name, "id_column")
        names = opts.get("columns") or {}
        if not isinstance(names, dict) or set(names) - set(QUEUE_COLUMNS):
            raise _Bad(f"mysql cursor: `columns` maps {', '.join(QUEUE_COLUMNS)} to the table's names")
        col = {c: _ident(names.get(c) or c, f"columns.{c}") for c in QUEUE_COLUMNS}
        self.status, self.by, self.at, self.attempts = (col[c] for c in QUEUE_COLUMNS)
        order = opts.get("order_by") or self.id_name
        self.order = ", ".join(self._order_term(t) for t in str(order).split(","))
        where = opts.get("where")
        self.where = f" AND ({where})" if where else ""
        self.done_status = str(opts.get("done_status") or "done")
        self.dead_status = str(opts.get("dead_status") or "dead")
        self.limit = int(opts.get("max_deliveries") or DEFAULT_MAX_DELIVERIES)
        if self.limit < 1:
            raise _Bad("mysql cursor: max_deliveries must be 1 or more")

    @staticmethod
    def _order_term(term: str) -> str:
        words = term.split()
        if not words or len(words) > 2 or (len(words) == 2 and words[1].upper() not in ("ASC", "DESC")):
            raise _Bad(f"mysql cursor: order_by takes column names with ASC/DESC, not {term!r}")
        return " ".join([_ident(words[0], "order_by"), *(w.upper() for w in words[1:])])

    def ack(self, cur: Any, slot: str, ids: list[Any]) -> None:
        marks = ", ".join(["%s"] * len(ids))
        cur.execute(
            f"UPDATE {self.table} SET {self.status} = %s "
            f"WHERE {self.id} IN ({marks}) AND {self.status} = 'claimed' AND {self.by} = %s",
            [self.done_status, *ids, slot],
        )

    def take(self, cur: Any, slot: str, lease: float, count: int) -> list[dict[str, Any]]:
        """Claim up to `count` rows (dead-lettering poison rows on the way); [] when none is free."""
        taken: list[Any] = []
        while len(taken) < count:
            # rows claimed by this slot match the filter and this transaction's own locks do not
            # skip them: the rows taken so far are left out by id
            besides = f" AND {self.id} NOT IN ({', '.join(['%s'] * len(taken))})" if taken else ""
            cur.execute(
                f"SELECT {self.id} AS id, {self.attempts} AS attempts FROM {self.table} "
                f"WHERE ({self.status} = 'pending' OR ({self.status} = 'claimed' AND ({self.by} = %s "
                f"OR {self.at} < NOW(6) - INTERVAL %s MICROSECOND))){self.where}{besides} "
                f"ORDER BY {self.order} LIMIT %s FOR UPDATE SKIP LOCKED",
                [slot, int(lease * 1_000_000), *taken, count - len(taken)],
            )
            found = cur.fetchall()
            if not found:
                break
            poison = [r["id"] for r in found if int(r["attempts"] or 0) >= self.limit]
            fresh = [r["id"] for r in found if int(r["attempts"] or 0) < self.limit]
            if poison:
                marks = ", ".join(["%s"] * len(poison))
                cur.execute(
                    f"UPDATE {self.table} SET {self.status} = %s WHERE {self.id} IN ({marks})",
                    [self.dead_status, *poison],
                )
            if fresh:
                cur.execute(
                    f"UPDATE {self.table} SET {self.status} = 'claimed', {self.by} = %s, {self.at} = NOW(6), "
                    f"{self.attempts} = {self.attempts} + 1 WHERE {self.id} IN ({', '.join(['%s'] * len(fresh))})",
                    [slot, *fresh],
                )
                taken.extend(fresh)
        if not taken:
            return []
        cur.execute(
            f"SELECT * FROM {self.table} WHERE {self.id} IN ({', '.join(['%s'] * len(taken))}) ORDER BY {self.order}",
            taken,
        )
        return [{str(k): _plain(v) for k, v in row.items()} for row in cur.fetchall()]


_local = threading.local()  # this thread's connections, by connect arguments


def _forget_after_fork() -> None:
    """A forked child (a prefork pool process) never uses its parent's connections: it drops
    them without closing (the sockets are the parent's) and opens its own."""
    global _local
    _local = threading.local()


os.register_at_fork(after_in_child=_forget_after_fork)


def _key(args: dict[str, Any]) -> str:
    return repr(sorted(args.items()))


def _connection(args: dict[str, Any]) -> Any:
    """This thread's connection for `args` (checked alive, opened again when it is not)."""
    import pymysql

    conns: dict[str, Any] = _local.__dict__.setdefault("conns", {})
    conn = conns.get(_key(args))
    if conn is not None:
        try:
            conn.ping(reconnect=False)
            return conn
        except pymysql.MySQLError:
            _drop(args)
    conn = conns[_key(args)] = pymysql.connect(
        **args,
        connect_timeout=CONNECT_TIMEOUT,
        autocommit=False,
        cursorclass=pymysql.cursors.DictCursor,
        init_command="SET SESSION TRANSACTION ISOLATION LEVEL READ COMMITTED",
    )
    return conn


def _drop(args: dict[str, Any]) -> None:
    conn = _local.__dict__.get("conns", {}).pop(_key(args), None)
    if conn is not None:
        with contextlib.suppress(Exception):
            conn.close()


def _claim_once(conn: Any, claim: _Claim, slot: str, lease: float, done: list[Any], count: int) -> list[dict[str, Any]]:
    with conn.cursor() as cur:
        try:
            if done:
                claim.ack(cur, slot, done)
            rows = claim.take(cur, slot, lease, count)
            conn.commit()
        except BaseException:
            conn.rollback()
            raise
    return rows


@register("mysql", keys=KEYS, needs_claim=False, extra="mysql", modules=("pymysql",))
def claim_mysql(call: ClaimCall) -> Outcome:
    import pymysql

    try:
        claim = _Claim(call.options)
        args = connect_args(call.credential)
        wait = wait_seconds(call)
        lease = reclaim_seconds(call)
    except (_Bad, TypeError, ValueError) as exc:
        return Outcome.fail(ToolErrorKind.INVALID_ARGS, str(exc))
    slot = str(call.params.get(SLOT_PARAM) or "noetl")
    done = [row[claim.id_name] for row in call.done if isinstance(row, dict) and claim.id_name in row]
    try:
        conn = _connection(args)
    except pymysql.MySQLError as exc:
        where = f"{args.get('host') or args.get('unix_socket')}:{args.get('port')}"
        code = exc.args[0] if exc.args else None
        if code in (1044, 1045):
            return Outcome.fail(
                ToolErrorKind.AUTHORIZATION, f"mysql cursor: the server at {where} refused the credential"
            )
        if code == 1049:
            return Outcome.fail(ToolErrorKind.NOT_FOUND, f"mysql cursor: {exc.args[1] if len(exc.args) > 1 else exc}")
        return Outcome.fail(ToolErrorKind.CONNECTION, f"mysql cursor: cannot reach a MySQL server at {where}", True)
    try:
        deadline = time.monotonic() + wait
        while True:
            rows = _claim_once(conn, claim, slot, lease, done, max(call.max_rows, 1))
            done = []
            if rows or time.monotonic() >= deadline:
                break
            time.sleep(POLL_INTERVAL)
    except pymysql.MySQLError as exc:
        _drop(args)
        code = exc.args[0] if exc.args else None
        message = exc.args[1] if len(exc.args) > 1 else str(exc)
        return Outcome.fail(
            ToolErrorKind.CURSOR, f"mysql cursor on {claim.table}: ({code}) {message}", code in _RETRYABLE
        )
    return Outcome.ok({"rows": rows})
