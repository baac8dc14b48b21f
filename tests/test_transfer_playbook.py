"""The transfer playbook (tests/playbooks/transfer_pg_mysql.yaml) on the in-process harness,
PostgreSQL -> MariaDB with each side's credential from NOETL_AUTH_<NAME>: the result as NoETL
gives it, the copy's rows in the target, and the source's password nowhere in what the run
prints."""

from __future__ import annotations

import json
import sqlite3
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import psycopg2

from tests.support import services as svc
from tests.support.harness import run_playbook

PLAYBOOK = Path(__file__).resolve().parent / "playbooks" / "transfer_pg_mysql.yaml"
PASSWORD = "pg-transfer-s3cret"  # the local server trusts loopback: any password connects


def fill_source(dsn: str, rows: int) -> None:
    with psycopg2.connect(dsn) as conn, conn.cursor() as cur:
        cur.execute("CREATE TABLE transfer_src (id int PRIMARY KEY, name text, amount numeric(10,2))")
        cur.execute("INSERT INTO transfer_src SELECT i, 'n' || i, i / 4.0 FROM generate_series(1, %s) i", [rows])


def credentials_env(fresh_postgres, mysql_url: str) -> dict[str, str]:
    return {
        "NOETL_AUTH_TRANSFER_PG": json.dumps({"dsn": f"{fresh_postgres.dsn} password={PASSWORD}"}),
        "NOETL_AUTH_TRANSFER_MYSQL": json.dumps({"url": mysql_url}),
    }


def test_the_transfer_playbook_copies_postgres_to_mariadb(fresh_postgres, tmp_path):
    fill_source(fresh_postgres.dsn, 1234)
    with svc.fresh_mysql_database(svc.mysql_server_url(), prefix="transfer_p_") as mysql_url:
        svc.mysql_query(
            mysql_url, "CREATE TABLE transfer_dst (id INT PRIMARY KEY, name VARCHAR(40), amount DECIMAL(10,2))"
        )
        check = tmp_path / "check.jsonl"
        code, status = run_playbook(
            f"sqlite:///{tmp_path / 'noetl.sqlite'}",
            PLAYBOOK,
            {"chunk_size": 500, "check_file": str(check)},
            {"NOETL_HOME": str(tmp_path), **credentials_env(fresh_postgres, mysql_url)},
        )
        assert code == 0, status
        copy = status["results"]["copy"]
        assert {k: copy[k] for k in ("status", "direction", "mode", "rows_transferred", "chunks_processed")} == {
            "status": "success",
            "direction": "postgres_to_mysql",
            "mode": "upsert",
            "rows_transferred": 1234,
            "chunks_processed": 3,
        }
        assert json.loads(check.read_text()) == {"n": 1234, "ids": 1234}
        assert float(svc.mysql_query(mysql_url, "SELECT SUM(amount) AS s FROM transfer_dst")[0]["s"]) == sum(
            i / 4 for i in range(1, 1235)
        )
        assert PASSWORD not in json.dumps(status)
        with sqlite3.connect(tmp_path / "noetl.sqlite") as store:
            events = store.execute("SELECT * FROM noetl_event").fetchall()
        assert len(events) > 5 and PASSWORD not in json.dumps(events, default=str)


NOETL_PLAYBOOK = Path(__file__).resolve().parent / "playbooks" / "corpus" / "http_to_postgres_transfer.yaml"
POSTS = [{"userId": 1 + i // 10, "id": i, "title": f"title {i}", "body": f"body {i}"} for i in range(1, 101)]


class _Posts(BaseHTTPRequestHandler):
    def do_GET(self) -> None:  # noqa: N802
        body = json.dumps(POSTS).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


def test_noetls_http_to_postgres_transfer_playbook_runs_unchanged(fresh_postgres, tmp_path):
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Posts)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        code, status = run_playbook(
            f"sqlite:///{tmp_path / 'noetl.sqlite'}",
            NOETL_PLAYBOOK,
            {"api_url": f"http://127.0.0.1:{server.server_address[1]}/posts"},
            {"NOETL_HOME": str(tmp_path), "NOETL_AUTH_PG_LOCAL": json.dumps({"dsn": fresh_postgres.dsn})},
        )
    finally:
        server.shutdown()
        server.server_close()
    assert code == 0, status
    copy = status["results"]["transfer_http_to_pg"]
    assert (copy["direction"], copy["mode"], copy["rows_transferred"]) == ("http_to_postgres", "insert", 100)
    assert copy["columns"] == ["post_id", "user_id", "title", "body"]
    assert status["results"]["show_count"]["rows"] == [{"records": 100}]
    with psycopg2.connect(fresh_postgres.dsn) as conn, conn.cursor() as cur:
        cur.execute("SELECT post_id, user_id, title FROM http_to_postgres_transfer WHERE post_id = 42")
        assert cur.fetchall() == [(42, 5, "title 42")]
