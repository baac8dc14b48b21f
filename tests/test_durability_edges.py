"""Edges of durability that need no worker: a trickling HTTP body is cut off at its timeout,
`submit` with the broker down, `cancel` of an unknown or finished execution, a playbook timeout."""

from __future__ import annotations

import socket
import threading
import time

import pytest

from noetl_celery.compiler import compile_playbook
from noetl_celery.tools.base import ToolCall, run_tool
from tests.support.engines import cli
from tests.support.services import free_port

TRICKLE_GAP = 0.5  # seconds between two bytes of the body


def _trickle_server(stop: threading.Event) -> tuple[str, threading.Thread]:
    server = socket.create_server(("127.0.0.1", 0))
    server.settimeout(0.2)
    url = f"http://127.0.0.1:{server.getsockname()[1]}/slow"

    def serve() -> None:
        while not stop.is_set():
            try:
                conn, _ = server.accept()
            except TimeoutError:
                continue
            with conn:
                conn.recv(65536)
                conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nContent-Length: 100\r\n\r\n")
                for _ in range(100):
                    if stop.wait(TRICKLE_GAP):
                        break
                    try:
                        conn.sendall(b"x")
                    except OSError:
                        break
        server.close()

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    return url, thread


def test_a_trickling_http_body_is_cut_off_at_the_timeout():
    stop = threading.Event()
    url, thread = _trickle_server(stop)
    try:
        started = time.monotonic()
        outcome = run_tool(ToolCall(kind="http", config={"url": url, "method": "GET"}, timeout=2.0))
        took = time.monotonic() - started
    finally:
        stop.set()
        thread.join(5)
    assert outcome.status == "error"
    assert outcome.error["kind"] == "timeout" and outcome.error["retryable"] is True
    assert "still arriving" in outcome.error["message"]
    assert took < 2.0 + 2 * TRICKLE_GAP + 1.0  # not 100 bytes x 0.5 s = 50 s


def test_submit_with_the_broker_down_exits_2_with_one_line_and_leaves_no_execution(tmp_path):
    playbook = tmp_path / "p.yaml"
    playbook.write_text(
        "apiVersion: noetl.io/v2\nkind: Playbook\nmetadata: {name: p}\nworkflow:\n"
        "  - step: start\n    tool: {kind: python, code: 'result = 1'}\n"
    )
    env = {
        "NOETL_BROKER_URL": f"redis://127.0.0.1:{free_port()}/0",
        "NOETL_DATABASE_URL": f"sqlite:///{tmp_path / 'store.sqlite'}",
    }
    proc = cli(["submit", str(playbook)], env)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: cannot reach the broker at redis://127.0.0.1:"), lines
    listing = cli(["executions"], env)
    assert listing.returncode == 0 and listing.stdout.strip() == ""


def test_cancel_of_an_unknown_execution_exits_2(tmp_path):
    env = {"NOETL_DATABASE_URL": f"sqlite:///{tmp_path / 'store.sqlite'}"}
    proc = cli(["cancel", "12345"], env)
    assert proc.returncode == 2 and "no execution 12345" in proc.stderr


@pytest.mark.parametrize("where", ["timeout: {v}\n", "executor:\n  spec:\n    timeout: {v}\n"])
def test_playbook_timeout_is_read_and_checked(tmp_path, where):
    base = "apiVersion: noetl.io/v2\nkind: Playbook\nmetadata: {name: p}\n"
    steps = "workflow:\n  - step: start\n    tool: {kind: python, code: 'result = 1'}\n"
    good = tmp_path / "good.yaml"
    good.write_text(base + where.format(v=90) + steps)
    assert compile_playbook(str(good)).timeout == 90.0
    bad = tmp_path / "bad.yaml"
    bad.write_text(base + where.format(v="-3") + steps)
    proc = cli(["validate", str(bad)], {})
    assert proc.returncode == 2
    assert "timeout: must be a positive number of seconds, not -3" in proc.stderr


def _backend_pid(conn) -> int:  # type: ignore[no-untyped-def]
    return int(conn.exec_driver_sql("SELECT pg_backend_pid()").scalar())


def _terminate(postgres_url: str, pid: int) -> None:
    import psycopg2

    admin = psycopg2.connect(postgres_url.replace("postgresql+psycopg2://", "postgresql://"))
    try:
        admin.autocommit = True
        with admin.cursor() as cur:
            cur.execute("SELECT pg_terminate_backend(%s)", (pid,))
    finally:
        admin.close()


def test_a_pooled_connection_dropped_while_idle_is_replaced_at_checkout(postgres_url, monkeypatch):
    from sqlalchemy.exc import DBAPIError

    from noetl_celery.store import db

    engine = db._create_engine(postgres_url)  # an engine of this test's own, not the process's
    try:
        with engine.connect() as conn:
            dropped = _backend_pid(conn)
        _terminate(postgres_url, dropped)  # e.g. a PgBouncer restart while the connection is pooled
        monkeypatch.setattr(db, "PING_AFTER_IDLE", 0.2)
        time.sleep(0.3)
        with engine.connect() as conn:  # idle long enough: pinged, replaced, the statement runs
            assert _backend_pid(conn) != dropped
        # a connection used moments ago is not pinged: its first statement meets the drop, the
        # pool is emptied and the caller's retry (the engine's delay-and-retry path) succeeds
        monkeypatch.setattr(db, "PING_AFTER_IDLE", 60.0)
        with engine.connect() as conn:
            dropped = _backend_pid(conn)
        _terminate(postgres_url, dropped)
        with pytest.raises(DBAPIError) as info, engine.connect() as conn:
            _backend_pid(conn)
        assert info.value.connection_invalidated
        with engine.connect() as conn:
            assert _backend_pid(conn) != dropped
    finally:
        engine.dispose()
