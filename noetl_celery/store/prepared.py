"""Prepared statements for the hot path's SQL on PostgreSQL with psycopg2.

Decides whether a statement `kernel.run` sends is planned by the server each time or prepared
once per connection. A decision's statement is planned anew by every `EXECUTE`-less send: its
CTEs cost the server about 0.2 ms of planning, more than executing it, and on a worker that
is not busy that planning is in the latency of every step of a chain. Here a statement text
sent a second time on one server connection is sent as `PREPARE name AS ...` followed by
`EXECUTE name(...)`, in the same round trip, and as `EXECUTE name(...)` from then on: the
server plans it once per connection (its generic plan, once its custom plans cost no less).

- A batch of several statements (`BEGIN; ...; COMMIT`, what `db.begin_prefix` and `defer` put in
  front) is cut at "; "; only the statements of the caller's own text with parameters are
  prepared, each under a name of its text's digest. Text whose placeholders do not add up to
  its parameters is sent as it is.
- Per connection (`Session`, made when the pool opens the connection) at most MAX_PREPARED
  statements are kept (about 100 KB of the server's memory each: 19 of them, 1.8 MB, after a loop,
  a chain and a retry); the least recently used is deallocated in front of the next batch.
- `PREPARE` and `DEALLOCATE` do not roll back with a transaction: when a batch that prepared
  or deallocated fails, which of them ran is unknown, so the session forgets every name and
  sends `DEALLOCATE ALL` in front of its next batch.
- A batch that prepared or executed by name and failed with an error its preparation may cause
  (PLAIN_AGAIN_CLASSES: a type the server cannot infer, a syntax `EXECUTE` cannot carry, a
  limit, a plan whose result type a migration changed), sent while no transaction was open, is
  rolled back and sent again as plain text (`kernel._as_text`). If the text runs, its statements
  are never prepared again on that connection; if it fails too, its error is the caller's. In a
  transaction opened before, the batch cannot be sent again: its error is raised and its text
  stays plain on that connection. Other errors (a key that exists, which the strict decision
  write expects now and then; a lock; a timeout) are the statement's own and raised as they are.
- Behind a transaction pooler (PgBouncer's `pool_mode = transaction`) a prepared statement
  lives on a server connection that the next transaction may not get. NOETL_PG_PREPARE=auto
  (the default) prepares only on a connection that reaches the server itself: the server's
  `port` setting is the URL's port, and on TCP the server's address is one the URL's host
  resolves to; a pooler in between differs in one or the other. `on` always prepares, `off`
  never. A statement the server says does not exist (26000), or exists already (42P05), turns
  preparation off for the process's engine: a pooler was missed; that batch's error is raised,
  and the caller's delay-and-retry path runs its unit of work again unprepared.
"""

from __future__ import annotations

import functools
import hashlib
import itertools
import logging
import os
import re
import socket
from collections import OrderedDict
from typing import Any

log = logging.getLogger(__name__)

PREPARE_AFTER = 2  # sends of one text on one connection before it is prepared (a text sent once stays plain)
MAX_PREPARED = 32  # kept per connection (about 100 KB of server memory each); the least recently used is deallocated
MAX_SEEN = 512  # texts counted per connection before the count starts over
NAME_PREFIX = "noetl_"
SEPARATOR = "; "
_LEAD = ("WITH ", "INSERT ", "UPDATE ", "DELETE ", "SELECT ")  # the statements that are prepared
POOLER_CODES = frozenset({"26000", "42P05"})  # invalid_sql_statement_name, duplicate_prepared_statement
# syntax or access rule, data exception, feature not supported (a cached plan's result type),
# program limit, internal error: what a preparation may cause
PLAIN_AGAIN_CLASSES = ("42", "22", "0A", "54", "XX")


def reaches_server(dbapi_connection: Any, host: str | None, port: int | None) -> bool:
    """Whether this new connection reaches the PostgreSQL server itself rather than a pooler or
    proxy in front of it (see the module docstring). Leaves no transaction open."""
    cursor = dbapi_connection.cursor()
    try:
        cursor.execute("SELECT current_setting('port'), host(inet_server_addr())")
        server_port, server_addr = cursor.fetchone()
    finally:
        cursor.close()
        dbapi_connection.rollback()
    if int(server_port) != (port or int(os.environ.get("PGPORT") or 5432)):
        return False
    if server_addr is None:  # a Unix socket on the server's side: no address to compare
        return not host or host.startswith("/")
    if not host or host.startswith("/"):
        return False  # a socket here, TCP at the server: something relays
    try:
        addresses = {info[4][0] for info in socket.getaddrinfo(host, None)}
    except OSError:
        return False
    return server_addr in addresses


class Session:
    """One server connection's prepared statements (kept in its pool record's info)."""

    def __init__(self) -> None:
        self.names: OrderedDict[str, str] = OrderedDict()  # statement text -> its prepared name
        self.seen: dict[str, int] = {}
        self.plain: set[str] = set()  # texts the server refused to prepare: never again here
        self.dropped: list[str] = []  # names to deallocate in front of the next batch
        self.reset = False  # DEALLOCATE ALL in front of the next batch
        self.changing = False  # the batch in flight prepares or deallocates

    def rewrite(self, sql: str, params: Any) -> tuple[str, Any]:
        """`sql` with `params` as the batch to send: its statements prepared or executed by name."""
        if not isinstance(params, tuple | list) or not params:
            return sql, params
        parts, counts = _shape(sql)
        if sum(counts) != len(params):
            return sql, params
        head: list[str] = []
        if self.reset:
            head.append("DEALLOCATE ALL")
        out: list[str] = []
        for part, count in zip(parts, counts, strict=True):
            if count == 0 or not part.startswith(_LEAD) or part in self.plain:
                out.append(part)
                continue
            name = self.names.get(part)
            if name is not None:
                self.names.move_to_end(part)
            elif self.seen.get(part, 0) + 1 >= PREPARE_AFTER:
                name = NAME_PREFIX + hashlib.blake2b(part.encode(), digest_size=12).hexdigest()
                out.append(f"PREPARE {name} AS {_numbered(part)}")
                self.names[part] = name
                self.changing = True
                while len(self.names) > MAX_PREPARED:
                    _, old = self.names.popitem(last=False)
                    self.dropped.append(old)
            else:
                if len(self.seen) >= MAX_SEEN:
                    self.seen.clear()
                self.seen[part] = self.seen.get(part, 0) + 1
                out.append(part)
                continue
            out.append(f"EXECUTE {name}({', '.join(['%s'] * count)})")
        head.extend(f"DEALLOCATE {name}" for name in self.dropped)
        self.changing = self.changing or bool(head)  # a failure then leaves the names unknown
        return SEPARATOR.join(head + out), params

    def succeeded(self) -> None:
        self.changing = False
        self.dropped.clear()
        self.reset = False

    def failed(self) -> None:
        """The batch failed: if it prepared or deallocated, which of those ran is unknown."""
        if self.changing or self.reset:
            self.names.clear()
            self.dropped.clear()
            self.reset = True
        self.changing = False

    def refused(self, sql: str) -> None:
        """The server refused `sql` prepared: its statements are sent as text from now on."""
        self.plain.update(part for part in sql.split(SEPARATOR) if part.startswith(_LEAD))
        self.failed()


_MARK = re.compile(r"%%|%s")


def _numbered(part: str) -> str:
    """A statement with `%s` placeholders as PREPARE's `$1, $2, ...` (its `%%` kept: the batch is
    formatted by the driver)."""
    numbers = itertools.count(1)
    return _MARK.sub(lambda m: m.group() if m.group() == "%%" else f"${next(numbers)}", part)


@functools.lru_cache(maxsize=1024)
def _shape(sql: str) -> tuple[tuple[str, ...], tuple[int, ...]]:
    """A batch's statements and the placeholders of each (the texts are the engine's own: few)."""
    parts = tuple(sql.split(SEPARATOR))
    return parts, tuple(sum(1 for m in _MARK.finditer(part) if m.group() == "%s") for part in parts)


KEY = "noetl_prepared"  # pool record info: the connection's Session (None: it prepares nothing)
_off: set[int] = set()  # ids of engines that found a pooler: no connection of theirs prepares


def session_of(connection_info: Any, engine: Any) -> Session | None:
    """The Session of a checked-out connection (its pool record's info), None where nothing is prepared."""
    session = connection_info.get(KEY)
    if session is None or id(engine) in _off:
        return None
    return session


def turn_off(engine: Any, exc: BaseException) -> None:
    """A pooler was missed (see the module docstring): no statement is prepared from now on."""
    if id(engine) not in _off:
        _off.add(id(engine))
        log.warning(
            "the event store's connections do not keep prepared statements (%s): a transaction pooler is in "
            "front of it; statements are no longer prepared in this process (set NOETL_PG_PREPARE=off to say so)",
            str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__,
        )


def on_connect(dbapi_connection: Any, record: Any, chosen: str, host: str | None, port: int | None) -> None:
    """A new pooled connection's Session, by NOETL_PG_PREPARE (`chosen`: auto, on or off)."""
    enabled = chosen == "on"
    if chosen == "auto":
        try:
            enabled = reaches_server(dbapi_connection, host, port)
        except Exception as exc:  # noqa: BLE001 - a check that cannot run leaves statements plain
            log.debug("cannot tell whether the store's connection reaches its server: %s", exc)
            enabled = False
    record.info[KEY] = Session() if enabled else None


def error_code(exc: BaseException) -> str:
    return str(getattr(exc, "pgcode", "") or "")


def plain_again(exc: BaseException) -> bool:
    """An error the batch's preparation may have caused (sent again as plain text)."""
    code = error_code(exc)
    return code.startswith(PLAIN_AGAIN_CLASSES) and code not in POOLER_CODES


def pooler_error(exc: BaseException) -> bool:
    return error_code(exc) in POOLER_CODES
