"""A PgBouncer of a test's own, in transaction pooling mode, in front of the local PostgreSQL.

Debian's `pgbouncer` (apt-get install pgbouncer). It listens on a free loopback port, passes
every database through to the PostgreSQL server of the test session (trust authentication, as
that server has) and refuses to run as root, so as root it switches to the `postgres` user."""

from __future__ import annotations

import contextlib
import os
import pwd
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import psycopg2
from sqlalchemy.engine import make_url

from tests.support.services import free_port, stop_process

BINARY = "pgbouncer"


@dataclass
class Bouncer:
    host: str
    port: int
    user: str
    logfile: Path

    def url(self, direct_url: str) -> str:
        """`direct_url` (a database on the PostgreSQL server) through this PgBouncer."""
        return make_url(direct_url).set(host=self.host, port=self.port).render_as_string(hide_password=False)

    def stats(self, database: str) -> dict[str, int]:
        """SHOW STATS of the admin console for `database`: transactions and queries served."""
        conn = psycopg2.connect(host=self.host, port=self.port, user=self.user, dbname="pgbouncer")
        conn.autocommit = True
        try:
            with conn.cursor() as cur:
                cur.execute("SHOW STATS")
                names = [c[0] for c in cur.description]
                for row in cur.fetchall():
                    found = dict(zip(names, row, strict=True))
                    if found["database"] == database:
                        return {k: int(v) for k, v in found.items() if k.startswith("total_")}
        finally:
            conn.close()
        return {}


def available() -> str | None:
    return shutil.which(BINARY) or next((p for p in ("/usr/sbin/pgbouncer",) if os.path.exists(p)), None)


@contextlib.contextmanager
def pgbouncer(server_url: str, *, pool_size: int = 10) -> Iterator[Bouncer]:
    """A transaction-pooling PgBouncer in front of `server_url`'s server, stopped on exit (its
    files in a directory of its own under /tmp: the `postgres` user must reach them)."""
    binary = available()
    if binary is None:
        raise RuntimeError("pgbouncer is not installed (apt-get install -y pgbouncer)")
    server = make_url(server_url)
    user = server.username or "postgres"
    port = free_port()
    workdir = Path(tempfile.mkdtemp(prefix=f"pgbouncer-{port}-"))
    (workdir / "users.txt").write_text(f'"{user}" ""\n')
    logfile = workdir / "pgbouncer.log"
    (workdir / "pgbouncer.ini").write_text(
        "\n".join(
            [
                "[databases]",
                f"* = host={server.host or '127.0.0.1'} port={server.port or 5432}",
                "[pgbouncer]",
                "listen_addr = 127.0.0.1",
                f"listen_port = {port}",
                "unix_socket_dir =",
                "auth_type = trust",
                f"auth_file = {workdir / 'users.txt'}",
                f"admin_users = {user}",
                "pool_mode = transaction",
                f"default_pool_size = {pool_size}",
                "max_client_conn = 500",
                f"logfile = {logfile}",
                "",
            ]
        )
    )
    command = [binary, str(workdir / "pgbouncer.ini")]
    if os.geteuid() == 0:  # pgbouncer will not run as root
        owner = pwd.getpwnam("postgres")
        os.chown(workdir, owner.pw_uid, owner.pw_gid)
        for child in workdir.iterdir():
            os.chown(child, owner.pw_uid, owner.pw_gid)
        logfile.touch()
        os.chown(logfile, owner.pw_uid, owner.pw_gid)
        command += ["-u", "postgres"]
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 15
        while True:
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), timeout=0.5):
                break
            if proc.poll() is not None or time.monotonic() > deadline:
                out = proc.stdout.read().decode() if proc.stdout else ""
                raise RuntimeError(f"pgbouncer did not start: {out} {logfile.read_text() if logfile.exists() else ''}")
            time.sleep(0.05)
        yield Bouncer("127.0.0.1", port, user, logfile)
    finally:
        stop_process(proc, timeout=5)
        shutil.rmtree(workdir, ignore_errors=True)
