"""Real Redis, RabbitMQ and PostgreSQL servers for the test suite.

Where a server comes from, in this order (see `Services`):

(a) configured: env ``NOETL_TEST_REDIS_URL`` / ``NOETL_TEST_POSTGRES_URL`` (a server-level URL,
    e.g. ``redis://127.0.0.1:6379`` and ``postgresql://postgres@127.0.0.1:5432/postgres``).
    A configured server that does not answer is reported, not silently replaced.
    RabbitMQ: env ``NOETL_TEST_AMQP_URL`` (e.g. ``amqp://guest:guest@127.0.0.1:5672//``).
(b) the local default servers (``DEFAULT_REDIS_URL``, ``DEFAULT_AMQP_URL``,
    ``DEFAULT_POSTGRES_URL``) if they answer within about 1 s (and, for PostgreSQL, the role may
    create databases);
(c) throw-away servers started from the installed binaries on free loopback ports in a temp dir
    (`RedisServer`, `PostgresCluster`), stopped when the session ends. There is no throw-away
    RabbitMQ: without a server the amqp tests skip (fail with CI=true).

When none is possible the fixtures call `unavailable(reason)`: ``pytest.skip`` normally,
``pytest.fail`` when env ``CI`` is true (CI must not go green by skipping).

Isolation
---------
Redis: each test session claims its own **database index** among 1..15 (`claim_redis_db`), never
0 (a developer's own default). A claim is a key ``noetl:test:session-claim`` in that database,
set by a Lua script that in one step checks the key is absent, checks that the database is empty
or marked as the test suite's (``noetl:test:owned``: only a crashed session leaves data behind),
FLUSHDBs it and sets both keys (the claim with a 3 h TTL, so a crashed session frees it; a claim
left by a dead process on this host is taken over at once). A database holding anyone else's
data is never claimed, so never flushed. The session FLUSHDBs it again and drops the claim at the
end. A database
index rather than a key prefix because Celery/kombu (broker queues, unacked sets, result keys,
pidbox fanout channels, which kombu prefixes with the db number) and the code under test can
then use any key names, and FLUSHDB cleans everything at once. Tests must not FLUSHDB the
session database themselves (that would drop the claim); a test that needs its own can call
`claim_redis_db` again. If all 15 are taken, a throw-away server is started instead.

RabbitMQ: each session creates its own **virtual host** ``noetl_test_<pid>_<random>`` (`AmqpVhost`),
with full permissions for the URL's user, and deletes it (queues, exchanges, messages and all) at
the end. Created through the management HTTP API when it answers (port 15672, the URL's
credentials), else with ``rabbitmqctl`` when the server is on this machine and the command may
talk to it; with neither, the amqp tests are skipped (or fail with CI=true). Nothing outside the
session's vhost is created or deleted: the vhost's description records the host and pid that
made it, and only a vhost of a dead process on this host, so described, is removed as stale.

PostgreSQL: each session creates a fresh database ``noetl_test_<pid>_<random>`` (`fresh_database`,
also usable by tests that want one of their own), dropped at the end after terminating its
connections.

Throw-away servers get ``--pdeathsig`` (util-linux ``setpriv``) so that they die with the thread
that started them (the pytest main thread) even if pytest itself is killed. PostgreSQL refuses to
run as root: as root the cluster is created and run as the ``postgres`` OS user.
"""

from __future__ import annotations

import contextlib
import glob
import json
import os
import pwd
import secrets
import shutil
import signal
import socket
import subprocess
import tempfile
import time
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import NoReturn, Self
from urllib.parse import quote, unquote, urlsplit, urlunsplit

import pytest

DEFAULT_REDIS_URL = "redis://127.0.0.1:6379"
DEFAULT_POSTGRES_URL = "postgresql://postgres@127.0.0.1:5432/postgres"
DEFAULT_AMQP_URL = "amqp://guest:guest@127.0.0.1:5672//"
REDIS_URL_ENV = "NOETL_TEST_REDIS_URL"
AMQP_URL_ENV = "NOETL_TEST_AMQP_URL"
AMQP_MANAGEMENT_PORT = 15672
AMQP_VHOST_PREFIX = "noetl_test_"
POSTGRES_URL_ENV = "NOETL_TEST_POSTGRES_URL"

REDIS_CLAIM_KEY = "noetl:test:session-claim"
REDIS_OWNED_KEY = "noetl:test:owned"  # this database holds only what test sessions wrote
REDIS_CLAIM_TTL_MS = 3 * 3600 * 1000
REDIS_SESSION_DBS = range(1, 16)

BROKERS = ("redis", "amqp")  # the brokers tests run on (see the `broker` fixture in tests/conftest.py)
on_both_brokers = pytest.mark.parametrize("broker", BROKERS, indirect=True)  # a test, once per broker
ANSWER_TIMEOUT = 1.0  # seconds a local default server has to answer


class ServiceUnavailable(Exception):
    """No server of that kind could be had; the message says why."""


# --------------------------------------------------------------------------- helpers


def ci_mode() -> bool:
    """True when env CI says we run in CI (true/1/yes)."""
    return os.environ.get("CI", "").strip().lower() in ("true", "1", "yes")


def unavailable(reason: str) -> NoReturn:
    """Skip the test for lack of a service, or fail it in CI (env CI=true)."""
    if ci_mode():
        pytest.fail(f"service unavailable (CI=true, so this fails): {reason}", pytrace=False)
    pytest.skip(f"service unavailable: {reason}")


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free on `host` a moment ago (bind to port 0 and read it back)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _tcp_answers(host: str | None, port: int | None, timeout: float) -> bool:
    if not host or host.startswith("/"):
        return True  # unix socket: let the client try
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return True
    except OSError:
        return False


def _is_root() -> bool:
    return os.geteuid() == 0


def _process_alive(pid: int) -> bool:
    """True if `pid` exists and is not a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] not in ("Z", "X")


def _launcher(as_user: str | None, deathsig: str | None) -> list[str]:
    """Command prefix that switches to `as_user` and sets a parent-death signal, via setpriv.

    Empty when neither is wanted. Without setpriv only the user switch is possible (done by
    the caller through Popen's user=/group=), so it returns [] and the caller falls back.
    """
    setpriv = shutil.which("setpriv")
    if not setpriv or (as_user is None and deathsig is None):
        return []
    cmd = [setpriv]
    if as_user is not None:
        cmd += [f"--reuid={as_user}", f"--regid={as_user}", "--clear-groups"]
    if deathsig is not None:
        cmd += [f"--pdeathsig={deathsig}"]
    return cmd + ["--"]


def _popen_as(argv: Sequence[str], *, as_user: str | None, deathsig: str | None, **kwargs) -> subprocess.Popen:
    prefix = _launcher(as_user, deathsig)
    if as_user is not None and not prefix:
        pw = pwd.getpwnam(as_user)
        kwargs.update(user=pw.pw_uid, group=pw.pw_gid, extra_groups=[])
    return subprocess.Popen([*prefix, *argv], **kwargs)


def stop_process(proc: subprocess.Popen | None, sig: int = signal.SIGTERM, timeout: float = 10.0) -> None:
    """Send `sig` (a service manager's SIGTERM by default), wait `timeout` s, then SIGKILL."""
    if proc is None or proc.poll() is not None:
        return
    with contextlib.suppress(ProcessLookupError):
        proc.send_signal(sig)
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            proc.kill()
        proc.wait(10)


def _tail(path: Path, lines: int = 30) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


# --------------------------------------------------------------------------- Redis


def redis_base_url(url: str) -> str:
    """The server-level part of a Redis URL (database path and ?db= dropped)."""
    parts = urlsplit(url)
    if parts.scheme == "unix":
        query = "&".join(q for q in parts.query.split("&") if q and not q.startswith("db="))
        return urlunsplit((parts.scheme, parts.netloc, parts.path, query, ""))
    return urlunsplit((parts.scheme, parts.netloc, "", parts.query, ""))


def redis_db_url(server_url: str, db: int) -> str:
    """`server_url` pointed at database index `db`."""
    base = redis_base_url(server_url)
    parts = urlsplit(base)
    if parts.scheme == "unix":
        query = "&".join(q for q in (parts.query, f"db={db}") if q)
        return urlunsplit((parts.scheme, parts.netloc, parts.path, query, ""))
    return urlunsplit((parts.scheme, parts.netloc, f"/{db}", parts.query, ""))


def redis_client(url: str, timeout: float = 5.0):
    import redis

    return redis.Redis.from_url(url, socket_connect_timeout=timeout, socket_timeout=timeout)


def redis_answers(url: str, timeout: float = ANSWER_TIMEOUT) -> bool:
    """True if a Redis server at `url` answers PING within `timeout` seconds."""
    parts = urlsplit(url)
    if parts.scheme != "unix" and not _tcp_answers(parts.hostname or "127.0.0.1", parts.port or 6379, timeout):
        return False
    try:
        client = redis_client(url, timeout)
        try:
            return bool(client.ping())
        finally:
            client.close()
    except Exception:  # noqa: BLE001 - any failure means 'no'
        return False


def find_redis_server() -> str | None:
    return shutil.which("redis-server")


class RedisServer:
    """A throw-away ``redis-server`` on a free loopback port, nothing kept on disk.

    >>> with RedisServer() as srv: ...   # srv.url == "redis://127.0.0.1:<port>"
    """

    def __init__(
        self,
        port: int | None = None,
        workdir: str | Path | None = None,
        binary: str | None = None,
        die_with_parent: bool = True,
    ):
        self.binary = binary or find_redis_server()
        self.port = port
        self._own_dir = workdir is None
        self.workdir = Path(workdir) if workdir else None
        self.die_with_parent = die_with_parent
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}"

    @property
    def log_path(self) -> Path:
        assert self.workdir is not None
        return self.workdir / "redis.log"

    def start(self, timeout: float = 15.0) -> RedisServer:
        if not self.binary:
            raise ServiceUnavailable("redis-server is not installed")
        if self.workdir is None:
            self.workdir = Path(tempfile.mkdtemp(prefix="noetl-redis-"))
        fixed_port = self.port is not None
        last = ""
        for _attempt in range(1 if fixed_port else 3):
            if not fixed_port:
                self.port = free_port()
            argv = [
                self.binary,
                "--port",
                str(self.port),
                "--save",
                "",
                "--appendonly",
                "no",
                "--bind",
                "127.0.0.1",
                "--daemonize",
                "no",
                "--dir",
                str(self.workdir),
                "--logfile",
                str(self.log_path),
            ]
            self.proc = _popen_as(
                argv,
                as_user=None,
                deathsig="TERM" if self.die_with_parent else None,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.STDOUT,
                cwd=self.workdir,
            )
            deadline = time.monotonic() + timeout
            while time.monotonic() < deadline:
                if self.proc.poll() is not None:
                    break
                if redis_answers(self.url, 0.5):
                    return self
                time.sleep(0.05)
            last = _tail(self.log_path)
            stop_process(self.proc, signal.SIGKILL, 5)
        self.proc = None
        raise ServiceUnavailable(f"throw-away redis-server did not start:\n{last}")

    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self, timeout: float = 10.0) -> None:
        stop_process(self.proc, signal.SIGTERM, timeout)
        if self._own_dir and self.workdir is not None:
            shutil.rmtree(self.workdir, ignore_errors=True)

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


@dataclass
class RedisDbClaim:
    """A Redis database index held by this session (see the module doc)."""

    server_url: str
    db: int
    token: str
    released: bool = False

    @property
    def url(self) -> str:
        return redis_db_url(self.server_url, self.db)

    def release(self, flush: bool = True) -> None:
        """FLUSHDB (if `flush`) and drop the claim, only while it is still ours."""
        if self.released:
            return
        self.released = True
        with contextlib.suppress(Exception):
            client = redis_client(self.url)
            try:
                client.eval(_RELEASE_SCRIPT, 1, REDIS_CLAIM_KEY, self.token, 1 if flush else 0)
            finally:
                client.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc) -> None:
        self.release()


_CLAIM_SCRIPT = """
if redis.call('EXISTS', KEYS[1]) == 1 then return 0 end
if redis.call('DBSIZE') > 0 and redis.call('EXISTS', KEYS[2]) == 0 then return -1 end
redis.call('FLUSHDB')
redis.call('SET', KEYS[2], '1')
redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
return 1
"""
_RELEASE_SCRIPT = """
local v = redis.call('GET', KEYS[1])
if v and v ~= ARGV[1] then return 0 end
if ARGV[2] == '1' then redis.call('FLUSHDB') else redis.call('DEL', KEYS[1]) end
return 1
"""
_DROP_STALE_SCRIPT = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""


def _claim_is_stale(value: bytes | None) -> bool:
    """A claim made on this host by a process that no longer runs."""
    if value is None:
        return False
    try:
        owner = json.loads(value)
        return owner["host"] == socket.gethostname() and not _process_alive(int(owner["pid"]))
    except Exception:  # noqa: BLE001 - any failure means 'no'
        return False


def claim_redis_db(
    server_url: str, dbs: Sequence[int] | range = REDIS_SESSION_DBS, ttl_ms: int = REDIS_CLAIM_TTL_MS
) -> RedisDbClaim:
    """Claim (and FLUSHDB) the first free database index in `dbs` on `server_url`: one that no
    live session holds and that is empty or holds only what an earlier test session left."""
    import redis

    token = json.dumps({"host": socket.gethostname(), "pid": os.getpid(), "nonce": secrets.token_hex(6)})
    for db in dbs:
        url = redis_db_url(server_url, db)
        client = redis_client(url)
        try:
            current = client.get(REDIS_CLAIM_KEY)
            if _claim_is_stale(current):
                client.eval(_DROP_STALE_SCRIPT, 1, REDIS_CLAIM_KEY, current)
            if client.eval(_CLAIM_SCRIPT, 2, REDIS_CLAIM_KEY, REDIS_OWNED_KEY, token, ttl_ms) == 1:
                return RedisDbClaim(server_url=redis_base_url(server_url), db=db, token=token)
        except redis.ResponseError as exc:
            if "out of range" in str(exc).lower():
                break  # server has fewer databases
            raise
        finally:
            client.close()
    raise ServiceUnavailable(
        f"no free Redis database among {list(dbs)} on {server_url} "
        "(in use by a session, or holding data the tests did not write)"
    )


# --------------------------------------------------------------------------- RabbitMQ


def queued_messages(broker_url: str, queues: Sequence[str]) -> int:
    """Messages waiting (ready, not taken by a worker) in `queues` of the broker at `broker_url`."""
    if broker_url.startswith(("amqp://", "amqps://", "pyamqp://")):
        from kombu import Connection

        total = 0
        with Connection(broker_url, connect_timeout=5) as conn:
            for q in queues:
                channel = conn.channel()
                try:
                    total += channel.queue_declare(queue=q, passive=True).message_count
                except Exception:  # noqa: BLE001 - the queue was never declared: nothing in it
                    pass
                finally:
                    with contextlib.suppress(Exception):
                        channel.close()
        return total
    client = redis_client(broker_url)
    try:
        return sum(int(client.llen(q)) for q in queues)
    finally:
        client.close()


def amqp_answers(url: str, timeout: float = ANSWER_TIMEOUT) -> bool:
    """True if an AMQP server at `url` accepts a connection (login included) within `timeout` s."""
    parts = urlsplit(url)
    if not _tcp_answers(parts.hostname or "127.0.0.1", parts.port or 5672, timeout):
        return False
    try:
        from kombu import Connection

        with Connection(url, connect_timeout=timeout) as conn:
            conn.ensure_connection(max_retries=1)
        return True
    except Exception:  # noqa: BLE001 - any failure means 'no'
        return False


def amqp_vhost_of(url: str) -> str:
    """The virtual host an AMQP URL names (kombu's reading: an empty path or ``//`` is ``/``)."""
    path = urlsplit(url).path
    return unquote(path[1:]) if len(path) > 1 else "/"


def amqp_vhost_url(server_url: str, vhost: str) -> str:
    """`server_url` pointed at the virtual host `vhost`."""
    parts = urlsplit(server_url)
    return urlunsplit((parts.scheme, parts.netloc, "/" + quote(vhost, safe=""), parts.query, ""))


def _is_local_host(host: str | None) -> bool:
    return host in (None, "", "localhost", "127.0.0.1", "::1", socket.gethostname())


class _VhostAdmin:
    """Creates and deletes virtual hosts on one server, through whatever this machine offers."""

    how = ""

    def list(self) -> list[dict]:
        raise NotImplementedError

    def create(self, name: str, description: str, user: str) -> None:
        raise NotImplementedError

    def delete(self, name: str) -> None:
        raise NotImplementedError


class _HttpVhostAdmin(_VhostAdmin):
    """The management plugin's HTTP API (``/api/vhosts``, ``/api/permissions``)."""

    how = "management API"

    def __init__(self, base: str, user: str, password: str):
        self.base = base.rstrip("/")
        self.auth = (user, password)

    def _call(self, method: str, path: str, body: dict | None = None):
        import base64
        import urllib.request

        req = urllib.request.Request(
            self.base + path,
            method=method,
            data=None if body is None else json.dumps(body).encode(),
            headers={
                "content-type": "application/json",
                "authorization": "Basic " + base64.b64encode(":".join(self.auth).encode()).decode(),
            },
        )
        with urllib.request.urlopen(req, timeout=10) as resp:
            raw = resp.read()
        return json.loads(raw) if raw else None

    def list(self) -> list[dict]:
        return list(self._call("GET", "/api/vhosts") or [])

    def create(self, name: str, description: str, user: str) -> None:
        q = quote(name, safe="")
        self._call("PUT", f"/api/vhosts/{q}", {"description": description})
        perms = {"configure": ".*", "write": ".*", "read": ".*"}
        self._call("PUT", f"/api/permissions/{q}/{quote(user, safe='')}", perms)

    def delete(self, name: str) -> None:
        self._call("DELETE", f"/api/vhosts/{quote(name, safe='')}")


class _CtlVhostAdmin(_VhostAdmin):
    """``rabbitmqctl`` of a server on this machine."""

    how = "rabbitmqctl"

    def __init__(self, binary: str):
        self.binary = binary

    def _run(self, *args: str) -> str:
        proc = subprocess.run(
            [self.binary, "-q", *args], capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL
        )
        if proc.returncode != 0:
            raise ServiceUnavailable(f"rabbitmqctl {' '.join(args)} failed: {(proc.stderr or proc.stdout).strip()}")
        return proc.stdout

    def list(self) -> list[dict]:
        return list(json.loads(self._run("--formatter", "json", "list_vhosts", "name", "description") or "[]"))

    def create(self, name: str, description: str, user: str) -> None:
        self._run("add_vhost", name, "--description", description)
        self._run("set_permissions", "-p", name, user, ".*", ".*", ".*")

    def delete(self, name: str) -> None:
        self._run("delete_vhost", name)


def _vhost_admin(server_url: str) -> _VhostAdmin:
    """The way to manage virtual hosts of `server_url`: its management API if it answers, else
    rabbitmqctl when the server is on this machine. ServiceUnavailable when neither works."""
    parts = urlsplit(server_url)
    host = parts.hostname or "127.0.0.1"
    user, password = unquote(parts.username or "guest"), unquote(parts.password or "guest")
    tried = []
    if _tcp_answers(host, AMQP_MANAGEMENT_PORT, ANSWER_TIMEOUT):
        http = _HttpVhostAdmin(f"http://{host}:{AMQP_MANAGEMENT_PORT}", user, password)
        try:
            http.list()
            return http
        except Exception as exc:  # noqa: BLE001 - try the next way
            tried.append(f"management API: {exc}")
    else:
        tried.append(f"no management API on {host}:{AMQP_MANAGEMENT_PORT}")
    ctl = shutil.which("rabbitmqctl")
    if ctl and _is_local_host(parts.hostname):
        admin = _CtlVhostAdmin(ctl)
        try:
            admin.list()
            return admin
        except Exception as exc:  # noqa: BLE001 - e.g. not allowed to read the Erlang cookie
            tried.append(f"rabbitmqctl: {exc}")
    else:
        tried.append("no rabbitmqctl for this server")
    raise ServiceUnavailable("cannot create a RabbitMQ virtual host for the session (" + "; ".join(tried) + ")")


@dataclass
class AmqpVhost:
    """A virtual host created for a test session; `delete()` removes it and all it holds."""

    server_url: str
    name: str
    admin: _VhostAdmin
    deleted: bool = False

    @property
    def url(self) -> str:
        return amqp_vhost_url(self.server_url, self.name)

    def delete(self) -> None:
        if not self.deleted:
            self.deleted = True
            with contextlib.suppress(Exception):
                self.admin.delete(self.name)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc) -> None:
        self.delete()


def _vhost_is_stale(entry: dict) -> bool:
    """A session vhost (by name and description) made on this host by a process that is gone."""
    if not str(entry.get("name", "")).startswith(AMQP_VHOST_PREFIX):
        return False
    try:
        owner = json.loads(entry.get("description") or "")
        return owner["host"] == socket.gethostname() and not _process_alive(int(owner["pid"]))
    except Exception:  # noqa: BLE001 - not described by a test session: never ours to delete
        return False


def create_amqp_vhost(server_url: str, prefix: str = AMQP_VHOST_PREFIX) -> AmqpVhost:
    """A fresh virtual host ``<prefix><pid>_<random>`` on `server_url` with full permissions for
    the URL's user (use as a context manager or call `.delete()`). Vhosts left by crashed test
    sessions of this host are deleted first."""
    admin = _vhost_admin(server_url)
    with contextlib.suppress(Exception):
        for entry in admin.list():
            if _vhost_is_stale(entry):
                admin.delete(entry["name"])
    name = f"{prefix}{os.getpid()}_{secrets.token_hex(4)}"
    owner = json.dumps({"host": socket.gethostname(), "pid": os.getpid(), "by": "noetl_celery tests"})
    admin.create(name, owner, unquote(urlsplit(server_url).username or "guest"))
    vhost = AmqpVhost(server_url=server_url, name=name, admin=admin)
    if not amqp_answers(vhost.url, 5.0):
        vhost.delete()
        raise ServiceUnavailable(f"created vhost {name} on {server_url} but cannot connect to it")
    return vhost


# --------------------------------------------------------------------------- PostgreSQL


def _sa_url(url: str):
    from sqlalchemy.engine import make_url

    return make_url(url)


def libpq_url(url: str, database: str | None = None) -> str:
    """A ``postgresql://`` URI libpq/psycopg2 accept (a ``+driver`` suffix is dropped)."""
    u = _sa_url(url).set(drivername="postgresql")
    if database is not None:
        u = u.set(database=database)
    return u.render_as_string(hide_password=False)


def sqlalchemy_url(url: str, database: str | None = None, driver: str = "postgresql+psycopg2") -> str:
    """A SQLAlchemy URL with an explicit driver (default psycopg2)."""
    u = _sa_url(url).set(drivername=driver)
    if database is not None:
        u = u.set(database=database)
    return u.render_as_string(hide_password=False)


def libpq_dsn(url: str, database: str | None = None) -> str:
    """The same connection as a libpq key/value DSN (``host=... port=... user=... dbname=...``)."""
    u = _sa_url(url)
    fields: dict[str, object] = {
        "host": u.host,
        "port": u.port,
        "user": u.username,
        "password": u.password,
        "dbname": database if database is not None else u.database,
    }
    for key, value in u.query.items():  # e.g. ?sslmode=require or ?host=/run/postgresql
        if fields.get(key) is None:
            fields[key] = value if isinstance(value, str) else value[-1]

    def q(v: object) -> str:
        s = str(v)
        if s and all(c.isalnum() or c in "._-/:@" for c in s):
            return s
        return "'" + s.replace("\\", "\\\\").replace("'", "\\'") + "'"

    return " ".join(f"{k}={q(v)}" for k, v in fields.items() if v is not None)


def pg_connect(url: str, timeout: float = 5.0, **kwargs):
    """psycopg2 connection to `url` (libpq or SQLAlchemy form)."""
    import psycopg2

    return psycopg2.connect(libpq_url(url), connect_timeout=max(2, int(timeout + 0.999)), **kwargs)


def postgres_answers(url: str, timeout: float = ANSWER_TIMEOUT, need_createdb: bool = True) -> bool:
    """True if a PostgreSQL server at `url` accepts us within about `timeout` seconds.

    With `need_createdb`, the role must also be allowed to create databases.
    """
    u = _sa_url(url)
    host = u.host or (u.query.get("host") if isinstance(u.query.get("host"), str) else None)
    if host and not host.startswith("/") and not _tcp_answers(host, u.port or 5432, timeout):
        return False
    try:
        conn = pg_connect(url, timeout)
    except Exception:  # noqa: BLE001 - any failure means 'no'
        return False
    try:
        with conn.cursor() as cur:
            cur.execute("SELECT rolsuper OR rolcreatedb FROM pg_roles WHERE rolname = current_user")
            row = cur.fetchone()
        return bool(row and row[0]) if need_createdb else True
    except Exception:  # noqa: BLE001 - any failure means 'no'
        return False
    finally:
        conn.close()


def find_postgres_bindir() -> Path | None:
    """The directory holding ``initdb`` and ``postgres`` (PATH first, then the newest
    /usr/lib/postgresql/<version>/bin)."""
    initdb = shutil.which("initdb")
    if initdb:
        real = Path(os.path.realpath(initdb)).parent
        if (real / "postgres").exists():
            return real
    candidates = sorted(
        glob.glob("/usr/lib/postgresql/*/bin/initdb"),
        key=lambda p: int(Path(p).parts[-3]) if Path(p).parts[-3].isdigit() else 0,
    )
    for c in reversed(candidates):
        bindir = Path(c).parent
        if (bindir / "postgres").exists():
            return bindir
    return None


class PostgresCluster:
    """A throw-away PostgreSQL cluster (initdb + postgres) on a free loopback port.

    Trust auth, superuser ``postgres``, ``fsync=off``; the socket lives in the temp dir. As root
    it runs as the ``postgres`` OS user (PostgreSQL refuses root).

    >>> with PostgresCluster() as pg: ...   # pg.url == "postgresql://postgres@127.0.0.1:<port>/postgres"
    """

    def __init__(
        self,
        port: int | None = None,
        bindir: str | Path | None = None,
        os_user: str | None = None,
        die_with_parent: bool = True,
    ):
        self.bindir = Path(bindir) if bindir else find_postgres_bindir()
        self.port = port
        self.os_user = os_user if os_user is not None else ("postgres" if _is_root() else None)
        self.die_with_parent = die_with_parent
        self.workdir: Path | None = None
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"postgresql://postgres@127.0.0.1:{self.port}/postgres"

    @property
    def datadir(self) -> Path:
        assert self.workdir is not None
        return self.workdir / "data"

    @property
    def sockdir(self) -> Path:
        assert self.workdir is not None
        return self.workdir / "sock"

    @property
    def log_path(self) -> Path:
        assert self.workdir is not None
        return self.workdir / "postgres.log"

    def _env(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("PG")}
        env.update(LC_ALL="C", LANG="C", HOME=str(self.workdir))
        return env

    def _initdb(self) -> None:
        assert self.bindir is not None and self.workdir is not None
        argv = [
            str(self.bindir / "initdb"),
            "-D",
            str(self.datadir),
            "-A",
            "trust",
            "-U",
            "postgres",
            "-E",
            "UTF8",
            "--locale=C",
            "--no-sync",
        ]
        res = _popen_as(
            argv,
            as_user=self.os_user,
            deathsig=None,
            cwd=self.workdir,
            env=self._env(),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        out, _ = res.communicate(timeout=120)
        if res.returncode != 0:
            raise ServiceUnavailable(f"initdb failed ({res.returncode}):\n{out[-3000:]}")

    def start(self, timeout: float = 60.0) -> PostgresCluster:
        if self.bindir is None:
            raise ServiceUnavailable("PostgreSQL server binaries (initdb, postgres) are not installed")
        if self.os_user is not None:
            try:
                pw = pwd.getpwnam(self.os_user)
            except KeyError:
                raise ServiceUnavailable(
                    f"running as root and there is no OS user {self.os_user!r} to run PostgreSQL as"
                ) from None
        self.workdir = Path(tempfile.mkdtemp(prefix="noetl-pg-"))
        try:
            self.sockdir.mkdir()
            if self.os_user is not None:
                for p in (self.workdir, self.sockdir):
                    os.chown(p, pw.pw_uid, pw.pw_gid)
            self._initdb()
            fixed_port = self.port is not None
            last = ""
            for _attempt in range(1 if fixed_port else 3):
                if not fixed_port:
                    self.port = free_port()
                argv = [
                    str(self.bindir / "postgres"),
                    "-D",
                    str(self.datadir),
                    "-p",
                    str(self.port),
                    "-k",
                    str(self.sockdir),
                    "-c",
                    "listen_addresses=127.0.0.1",
                    "-c",
                    "fsync=off",
                    "-c",
                    "synchronous_commit=off",
                    "-c",
                    "full_page_writes=off",
                    "-c",
                    "max_connections=200",
                ]
                with open(self.log_path, "ab") as log:
                    if self.os_user is not None:
                        os.chown(self.log_path, pw.pw_uid, pw.pw_gid)
                    self.proc = _popen_as(
                        argv,
                        as_user=self.os_user,
                        deathsig="INT" if self.die_with_parent else None,
                        cwd=self.workdir,
                        env=self._env(),
                        stdin=subprocess.DEVNULL,
                        stdout=log,
                        stderr=subprocess.STDOUT,
                    )
                deadline = time.monotonic() + timeout
                while time.monotonic() < deadline:
                    if self.proc.poll() is not None:
                        break
                    if postgres_answers(self.url, 1.0):
                        return self
                    time.sleep(0.1)
                last = _tail(self.log_path)
                stop_process(self.proc, signal.SIGQUIT, 10)
            self.proc = None
            raise ServiceUnavailable(f"throw-away postgres did not start:\n{last}")
        except BaseException:
            self.stop()
            raise

    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self, timeout: float = 30.0) -> None:
        """Fast shutdown (SIGINT), then SIGKILL; the temp dir is removed."""
        stop_process(self.proc, signal.SIGINT, timeout)
        if self.workdir is not None:
            shutil.rmtree(self.workdir, ignore_errors=True)

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def _quote_ident(name: str) -> str:
    return '"' + name.replace('"', '""') + '"'


def new_database_name(prefix: str = "noetl_test") -> str:
    return f"{prefix}_{os.getpid()}_{secrets.token_hex(4)}"


def drop_database(server_url: str, name: str) -> None:
    """Terminate the connections to `name`, then drop it (if it exists)."""
    conn = pg_connect(server_url)
    conn.autocommit = True
    try:
        with conn.cursor() as cur:
            # Refuse new connections first, so a reconnecting pool cannot race the drop.
            cur.execute("SELECT 1 FROM pg_database WHERE datname = %s", (name,))
            if cur.fetchone() is None:
                return
            cur.execute(f"ALTER DATABASE {_quote_ident(name)} ALLOW_CONNECTIONS false")
            cur.execute(
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = %s AND pid <> pg_backend_pid()",
                (name,),
            )
            cur.execute(f"DROP DATABASE IF EXISTS {_quote_ident(name)}")
    finally:
        conn.close()


@dataclass
class FreshDatabase:
    """A database created for a test session or a test; `drop()` removes it."""

    server_url: str
    name: str
    dropped: bool = field(default=False)

    @property
    def url(self) -> str:
        """SQLAlchemy URL (``postgresql+psycopg2://``)."""
        return sqlalchemy_url(self.server_url, self.name)

    @property
    def libpq_url(self) -> str:
        return libpq_url(self.server_url, self.name)

    @property
    def dsn(self) -> str:
        """libpq key/value DSN."""
        return libpq_dsn(self.server_url, self.name)

    def drop(self) -> None:
        if not self.dropped:
            self.dropped = True
            drop_database(self.server_url, self.name)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc) -> None:
        self.drop()


def fresh_database(server_url: str, prefix: str = "noetl_test", template: str = "template0") -> FreshDatabase:
    """Create a database ``<prefix>_<pid>_<random>`` on `server_url` as a copy of `template`
    (template0: an empty one). Use it as a context manager or call `.drop()`."""
    name = new_database_name(prefix)
    conn = pg_connect(server_url)
    conn.autocommit = True
    try:
        with conn.cursor() as cur:
            cur.execute(f"CREATE DATABASE {_quote_ident(name)} TEMPLATE {_quote_ident(template)} ENCODING 'UTF8'")
    finally:
        conn.close()
    return FreshDatabase(server_url=server_url, name=name)


def migrated_template(server_url: str) -> FreshDatabase:
    """A database migrated to head once, for copying: `fresh_database(..., template=db.name)` is
    a migrated store in a fraction of the time Alembic takes. Nothing may stay connected to a
    template while it is copied: Alembic closes its connections when the migration ends."""
    from noetl_celery.store import db as store_db

    template = fresh_database(server_url, prefix="noetl_tmpl")
    try:
        store_db.migrate(template.url)
    except Exception:
        template.drop()
        raise
    return template


# --------------------------------------------------------------------------- session


class Services:
    """Finds or starts the servers for one test session and cleans up in `close()`.

    Each getter resolves once (a failure is remembered, so later fixtures fail fast with the
    same reason) and raises `ServiceUnavailable`.
    """

    def __init__(self) -> None:
        self._stack = contextlib.ExitStack()
        self._cache: dict[str, str | ServiceUnavailable] = {}
        self.sources: dict[str, str] = {}  # kind -> "configured" | "local" | "throw-away"

    def _cached(self, key: str, make) -> str:
        if key not in self._cache:
            try:
                self._cache[key] = make()
            except ServiceUnavailable as exc:
                self._cache[key] = exc
        value = self._cache[key]
        if isinstance(value, ServiceUnavailable):
            raise value
        return value

    # Redis
    def redis_server_url(self) -> str:
        return self._cached("redis_server", self._find_redis)

    def _find_redis(self) -> str:
        configured = os.environ.get(REDIS_URL_ENV)
        if configured:
            if not redis_answers(configured, 5.0):
                raise ServiceUnavailable(f"{REDIS_URL_ENV}={configured} does not answer PING")
            self.sources["redis"] = "configured"
            return redis_base_url(configured)
        if redis_answers(DEFAULT_REDIS_URL):
            self.sources["redis"] = "local"
            return DEFAULT_REDIS_URL
        return self._throwaway_redis()

    def _throwaway_redis(self) -> str:
        server = RedisServer()
        server.start()
        self._stack.callback(server.stop)
        self.sources["redis"] = "throw-away"
        return server.url

    def redis_url(self) -> str:
        """Server URL + this session's own database index."""
        return self._cached("redis", self._claim_redis)

    def _claim_redis(self) -> str:
        server = self.redis_server_url()
        try:
            claim = claim_redis_db(server)
        except ServiceUnavailable:
            if self.sources.get("redis") != "local":
                raise
            # every index taken on the shared local server: use a private one
            self._cache["redis_server"] = server = self._throwaway_redis()
            claim = claim_redis_db(server)
        self._stack.callback(claim.release)
        return claim.url

    # RabbitMQ
    def amqp_server_url(self) -> str:
        return self._cached("amqp_server", self._find_amqp)

    def _find_amqp(self) -> str:
        configured = os.environ.get(AMQP_URL_ENV)
        if configured:
            if not amqp_answers(configured, 5.0):
                raise ServiceUnavailable(f"{AMQP_URL_ENV}={configured} does not accept an AMQP connection")
            self.sources["amqp"] = "configured"
            return configured
        if amqp_answers(DEFAULT_AMQP_URL):
            self.sources["amqp"] = "local"
            return DEFAULT_AMQP_URL
        raise ServiceUnavailable(f"no RabbitMQ at {DEFAULT_AMQP_URL} (set {AMQP_URL_ENV})")

    def amqp_url(self) -> str:
        """Server URL + this session's own virtual host (deleted at close)."""
        return self._cached("amqp", self._create_vhost)

    def _create_vhost(self) -> str:
        vhost = create_amqp_vhost(self.amqp_server_url())
        self._stack.callback(vhost.delete)
        return vhost.url

    # PostgreSQL
    def postgres_server_url(self) -> str:
        return self._cached("postgres_server", self._find_postgres)

    def _find_postgres(self) -> str:
        configured = os.environ.get(POSTGRES_URL_ENV)
        if configured:
            if not postgres_answers(configured, 5.0):
                raise ServiceUnavailable(
                    f"{POSTGRES_URL_ENV}={configured} does not accept a "
                    "connection (or its role may not create databases)"
                )
            self.sources["postgres"] = "configured"
            return libpq_url(configured)
        if postgres_answers(DEFAULT_POSTGRES_URL):
            self.sources["postgres"] = "local"
            return DEFAULT_POSTGRES_URL
        cluster = PostgresCluster()
        cluster.start()
        self._stack.callback(cluster.stop)
        self.sources["postgres"] = "throw-away"
        return cluster.url

    def postgres_database(self) -> FreshDatabase:
        """This session's fresh database (created once, dropped at close)."""
        return self._database("postgres_db", fresh_database, "a test database")

    def migrated_template(self) -> FreshDatabase:
        """This session's migrated template database (created once, dropped at close)."""
        return self._database("postgres_template", migrated_template, "a migrated template database")

    def _database(self, key: str, make, what: str) -> FreshDatabase:
        if key not in self._cache:
            try:
                db = make(self.postgres_server_url())
            except ServiceUnavailable as exc:
                self._cache[key] = exc
                raise
            except Exception as exc:
                self._cache[key] = ServiceUnavailable(f"cannot create {what}: {exc}")
                raise self._cache[key] from exc
            self._stack.callback(db.drop)
            self._cache[key] = db  # type: ignore[assignment]
        value = self._cache[key]
        if isinstance(value, ServiceUnavailable):
            raise value
        return value  # type: ignore[return-value]

    def close(self) -> None:
        self._stack.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


@contextlib.contextmanager
def throwaway_redis() -> Iterator[RedisServer]:
    with RedisServer() as srv:
        yield srv


@contextlib.contextmanager
def throwaway_postgres() -> Iterator[PostgresCluster]:
    with PostgresCluster() as pg:
        yield pg


class OwnRedis:
    """A redis-server on a fixed free port that can be stopped and started again on the same
    port and directory (optionally with AOF, fsync on every write)."""

    def __init__(self, aof: bool):
        self.binary = find_redis_server()
        if not self.binary:
            pytest.skip("redis-server is not installed")
        self.port = free_port()
        self.dir = Path(tempfile.mkdtemp(prefix="noetl-outage-redis-"))
        self.aof = aof
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        persistence = ["--appendonly", "yes", "--appendfsync", "always"] if self.aof else ["--appendonly", "no"]
        self.proc = subprocess.Popen(
            [
                self.binary,
                "--port",
                str(self.port),
                "--bind",
                "127.0.0.1",
                "--save",
                "",
                "--dir",
                str(self.dir),
                *persistence,
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.STDOUT,
        )
        deadline = time.monotonic() + 15
        while not redis_answers(self.url, 0.5):
            assert time.monotonic() < deadline, "redis-server did not start"
            time.sleep(0.05)

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.send_signal(signal.SIGTERM)
            self.proc.wait(15)
            self.proc = None

    def cleanup(self) -> None:
        self.stop()
        shutil.rmtree(self.dir, ignore_errors=True)


# --------------------------------------------------------------------------- MariaDB / MySQL, NATS

MYSQL_URL_ENV = "NOETL_TEST_MYSQL_URL"
DEFAULT_MYSQL_URL = "mysql://root@127.0.0.1:3306"
NATS_URL_ENV = "NOETL_TEST_NATS_URL"
DEFAULT_NATS_URL = "nats://127.0.0.1:4222"


def mysql_server_url() -> str:
    """The MariaDB/MySQL server tests use (a user that may create databases), or unavailable()."""
    url = os.environ.get(MYSQL_URL_ENV, DEFAULT_MYSQL_URL)
    parts = urlsplit(url)
    if not _tcp_answers(parts.hostname, parts.port or 3306, ANSWER_TIMEOUT):
        unavailable(f"no MySQL/MariaDB server at {parts.hostname}:{parts.port or 3306} (set {MYSQL_URL_ENV})")
    return url


def _mysql_connect(url: str, database: str | None = None):
    import pymysql

    parts = urlsplit(url)
    return pymysql.connect(
        host=parts.hostname,
        port=parts.port or 3306,
        user=unquote(parts.username or "root"),
        password=unquote(parts.password or ""),
        database=database,
        autocommit=True,
        connect_timeout=5,
    )


@contextlib.contextmanager
def fresh_mysql_database(server_url: str, prefix: str = "noetl_test_") -> Iterator[str]:
    """A MySQL database of the caller's own (its URL), dropped afterwards."""
    name = f"{prefix}{uuid.uuid4().hex[:12]}"
    conn = _mysql_connect(server_url)
    try:
        with conn.cursor() as cur:
            cur.execute(f"CREATE DATABASE `{name}`")
    finally:
        conn.close()
    try:
        yield f"{server_url.rstrip('/')}/{name}"
    finally:
        conn = _mysql_connect(server_url)
        try:
            with conn.cursor() as cur:
                cur.execute(f"DROP DATABASE IF EXISTS `{name}`")
        finally:
            conn.close()


def mysql_query(url: str, sql: str, params: Sequence[object] = ()) -> list[dict]:
    """Run one statement on the database `url` names; its rows as mappings."""
    import pymysql

    parts = urlsplit(url)
    conn = _mysql_connect(url, parts.path.strip("/") or None)
    try:
        with conn.cursor(pymysql.cursors.DictCursor) as cur:
            cur.execute(sql, params or None)
            return list(cur.fetchall())
    finally:
        conn.close()


def nats_server_url() -> str:
    """The NATS server (with JetStream) tests use, or unavailable()."""
    url = os.environ.get(NATS_URL_ENV, DEFAULT_NATS_URL)
    parts = urlsplit(url)
    if not _tcp_answers(parts.hostname, parts.port or 4222, ANSWER_TIMEOUT):
        unavailable(f"no NATS server at {parts.hostname}:{parts.port or 4222} (set {NATS_URL_ENV})")
    return url
