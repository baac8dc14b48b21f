"""The transfer tool called directly, against the machine's PostgreSQL and MariaDB, DuckDB and
SQLite files, CSV/JSONL/Parquet files and an HTTP server on loopback: rows counted, each mode's
SQL, upsert keys making a repeated copy write each row once, errors naming the side and the
field, credentials masked."""

from __future__ import annotations

import contextlib
import io
import json
import sqlite3
import threading
import uuid
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import psycopg2
import pytest

from noetl_celery.tools.base import SECRET_VALUES_META, ToolCall, run_tool
from noetl_celery.tools.transfer import streams
from tests.support import services as svc

ROWS = 2500


@pytest.fixture
def pg(fresh_postgres) -> Iterator[str]:
    """A fresh database with `src` (ROWS rows: id, name, amount, meta jsonb) and an empty `dst`."""
    with psycopg2.connect(fresh_postgres.dsn) as conn, conn.cursor() as cur:
        cur.execute("CREATE TABLE src (id int PRIMARY KEY, name text, amount numeric(10,2), meta jsonb)")
        cur.execute(
            "INSERT INTO src SELECT i, 'n' || i, i * 1.5, jsonb_build_object('i', i) FROM generate_series(1, %s) i",
            [ROWS],
        )
        cur.execute("CREATE TABLE dst (id int PRIMARY KEY, name text, amount numeric(10,2), meta jsonb)")
    yield fresh_postgres.dsn


@pytest.fixture
def mysql_url() -> Iterator[str]:
    with svc.fresh_mysql_database(svc.mysql_server_url(), prefix="transfer_t_") as url:
        svc.mysql_query(url, "CREATE TABLE dst (id INT PRIMARY KEY, name VARCHAR(40), amount DECIMAL(10,2), meta JSON)")
        yield url


def transfer(config: dict[str, Any], **call: Any) -> Any:
    return run_tool(ToolCall(kind="transfer", config=config, **call))


def pg_rows(dsn: str, sql: str) -> list[tuple]:
    with psycopg2.connect(dsn) as conn, conn.cursor() as cur:
        cur.execute(sql)
        return cur.fetchall()


def test_postgres_to_mariadb_in_chunks_counts_rows(pg, mysql_url):
    outcome = transfer(
        {
            "source": {"type": "postgres", "auth": {"dsn": pg}, "query": "SELECT * FROM src ORDER BY id"},
            "target": {"type": "mysql", "auth": {"url": mysql_url}, "table": "dst"},
            "chunk_size": 1000,
        }
    )
    assert outcome.status == "ok", outcome.error
    data = outcome.data
    assert (data["rows_transferred"], data["chunks_processed"]) == (ROWS, 3)
    assert data["direction"] == "postgres_to_mysql" and data["mode"] == "append" and data["status"] == "success"
    assert data["columns"] == ["id", "name", "amount", "meta"] and data["target_table"] == "dst"
    got = svc.mysql_query(mysql_url, "SELECT COUNT(*) AS n, SUM(amount) AS s FROM dst")[0]
    assert got["n"] == ROWS and float(got["s"]) == sum(i * 1.5 for i in range(1, ROWS + 1))
    row = svc.mysql_query(mysql_url, "SELECT * FROM dst WHERE id = 7")[0]
    assert row["name"] == "n7" and json.loads(row["meta"]) == {"i": 7}


def test_upsert_twice_writes_each_row_once_and_updates(pg, mysql_url):
    config = {
        "source": {"type": "postgres", "auth": {"dsn": pg}, "query": "SELECT id, name FROM src"},
        "target": {"type": "mariadb", "auth": {"url": mysql_url}, "table": "dst"},
        "mode": "upsert",
        "key": "id",
        "chunk_size": 700,
    }
    assert transfer(config).status == "ok"
    pg_rows(pg, "UPDATE src SET name = 'changed' WHERE id <= 10 RETURNING id")
    again = transfer(config)
    assert again.status == "ok", again.error
    assert again.data["rows_transferred"] == ROWS
    got = svc.mysql_query(mysql_url, "SELECT COUNT(*) AS n, COUNT(DISTINCT id) AS d FROM dst")[0]
    assert got == {"n": ROWS, "d": ROWS}
    assert svc.mysql_query(mysql_url, "SELECT COUNT(*) AS n FROM dst WHERE name = 'changed'")[0]["n"] == 10


def test_mariadb_to_postgres_upsert_and_replace(pg, mysql_url):
    svc.mysql_query(
        mysql_url, "INSERT INTO dst (id, name, amount) VALUES (1, 'a', 1.25), (2, 'b', 2.50), (3, 'c', NULL)"
    )
    pg_rows(pg, "INSERT INTO dst (id, name) VALUES (2, 'old'), (99, 'stays') RETURNING id")
    base = {
        "source": {"type": "mysql", "connection": mysql_url, "table": "dst"},
        "target": {"type": "postgres", "auth": {"dsn": pg}, "table": "dst"},
    }
    upsert = transfer({**base, "mode": "upsert"})  # key: the first column, as NoETL does
    assert upsert.status == "ok", upsert.error
    assert pg_rows(pg, "SELECT id, name FROM dst ORDER BY id") == [(1, "a"), (2, "b"), (3, "c"), (99, "stays")]
    replace = transfer({**base, "mode": "replace"})
    assert replace.status == "ok", replace.error
    assert pg_rows(pg, "SELECT id, name, amount::text FROM dst ORDER BY id") == [
        (1, "a", "1.25"),
        (2, "b", "2.50"),
        (3, "c", None),
    ]


def test_replace_is_one_transaction_a_failing_copy_leaves_the_old_rows(pg):
    pg_rows(pg, "INSERT INTO dst (id, name) VALUES (1, 'old') RETURNING id")
    outcome = transfer(
        {
            "source": {
                "type": "postgres",
                "auth": {"dsn": pg},
                "query": "SELECT id, name FROM src UNION ALL SELECT 5, 'dup'",
            },
            "target": {"type": "postgres", "auth": {"dsn": pg}, "table": "dst"},
            "mode": "replace",
            "chunk_size": 100,
        }
    )
    assert outcome.status == "error" and outcome.error["kind"] == "sql_error"
    assert outcome.error["message"].startswith("transfer: target (postgres): UniqueViolation")
    assert pg_rows(pg, "SELECT id, name FROM dst") == [(1, "old")]


def test_mapping_and_custom_target_query(pg, tmp_path):
    db = tmp_path / "t.sqlite"
    with sqlite3.connect(db) as conn:
        conn.execute("CREATE TABLE people (pid INTEGER PRIMARY KEY, label TEXT, i INTEGER)")
    outcome = transfer(
        {
            "source": {
                "type": "postgres",
                "auth": {"dsn": pg},
                "query": "SELECT id, name, meta FROM src WHERE id <= 5",
            },
            "target": {
                "type": "sqlite",
                "database": str(db),
                "table": "people",
                "mapping": {"pid": "id", "label": "name", "i": "meta.i"},
            },
        }
    )
    assert outcome.status == "ok", outcome.error
    assert outcome.data["columns"] == ["pid", "label", "i"]
    custom = transfer(
        {
            "source": {"type": "sqlite", "database": str(db), "query": "SELECT pid, label FROM people"},
            "target": {
                "type": "postgres",
                "auth": {"dsn": pg},
                "query": "INSERT INTO dst (id, name) VALUES (%s, upper(%s))",
            },
        }
    )
    assert custom.status == "ok", custom.error and custom.data["mode"] == "append"
    assert pg_rows(pg, "SELECT id, name FROM dst ORDER BY id") == [(i, f"N{i}") for i in range(1, 6)]


def test_sqlite_and_duckdb_upsert_by_key(tmp_path):
    db, duck = tmp_path / "s.sqlite", tmp_path / "d.duckdb"
    with sqlite3.connect(db) as conn:
        conn.execute("CREATE TABLE t (k TEXT, v INTEGER, PRIMARY KEY (k))")
        conn.executemany("INSERT INTO t VALUES (?, ?)", [(f"k{i}", i) for i in range(1200)])
    import duckdb

    with duckdb.connect(str(duck)) as conn:
        conn.execute("CREATE TABLE t (v INTEGER, k VARCHAR PRIMARY KEY)")
    config = {
        "source": {"type": "sqlite", "database": str(db), "query": "SELECT v, k FROM t"},
        "target": {"type": "duckdb", "database": str(duck), "table": "t"},
        "mode": "upsert",
        "key": ["k"],
        "chunk_size": 512,
    }
    for _ in range(2):
        outcome = transfer(config)
        assert outcome.status == "ok", outcome.error
        assert outcome.data["rows_transferred"] == 1200 and outcome.data["chunks_processed"] == 3
    back = transfer(
        {
            "source": {"type": "duckdb", "database": str(duck), "query": "SELECT k, v * 2 AS v FROM t"},
            "target": {"type": "sqlite", "database": str(db), "table": "t"},
            "mode": "upsert",
            "key": "k",
        }
    )
    assert back.status == "ok", back.error
    with duckdb.connect(str(duck)) as conn:
        assert conn.execute("SELECT COUNT(*), SUM(v) FROM t").fetchone() == (1200, sum(range(1200)))
    with sqlite3.connect(db) as conn:
        assert conn.execute("SELECT COUNT(*), SUM(v) FROM t").fetchone() == (1200, 2 * sum(range(1200)))


@pytest.mark.parametrize("fmt", ["csv", "jsonl", "parquet"])
def test_files_round_trip_through_each_format(pg, tmp_path, fmt):
    path = tmp_path / f"out.{fmt}"
    out = transfer(
        {
            "source": {
                "type": "postgres",
                "auth": {"dsn": pg},
                "query": "SELECT id, name, amount FROM src ORDER BY id",
            },
            "target": {"type": "file", "path": str(path)},
            "chunk_size": 1000,
        }
    )
    assert out.status == "ok", out.error
    assert out.data["rows_transferred"] == ROWS and out.data["target_table"] == str(path)
    assert not list(tmp_path.glob("*.part-*"))
    back = transfer(
        {
            "source": {"type": fmt, "path": str(path)},
            "target": {"type": "postgres", "auth": {"dsn": pg}, "table": "dst"},
            "chunk_size": 999,
        }
    )
    assert back.status == "ok", back.error
    assert (back.data["rows_transferred"], back.data["chunks_processed"]) == (ROWS, 3)
    assert pg_rows(pg, "SELECT count(*), sum(amount) FROM dst") == pg_rows(pg, "SELECT count(*), sum(amount) FROM src")


def test_a_failed_file_copy_leaves_no_file(tmp_path, pg):
    path = tmp_path / "out.csv"
    outcome = transfer(
        {
            "source": {
                "type": "postgres",
                "auth": {"dsn": pg},
                "query": "SELECT id, 1 / (id - 1500) AS x FROM src ORDER BY id",
            },
            "target": {"type": "csv", "path": str(path)},
            "chunk_size": 100,
        }
    )
    assert outcome.status == "error" and outcome.error["kind"] == "sql_error", outcome.error
    assert "source (postgres): DivisionByZero" in outcome.error["message"]
    assert list(tmp_path.iterdir()) == []


class _Api(BaseHTTPRequestHandler):
    received: list[Any] = []

    def do_GET(self) -> None:  # noqa: N802
        if self.headers.get("Authorization") != "Bearer tok-s3cret-1":
            self.send_response(401)
            self.end_headers()
            return
        body = json.dumps({"data": {"items": [{"id": i, "user": {"name": f"u{i}"}} for i in range(1, 26)]}}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_POST(self) -> None:  # noqa: N802
        self.received.append(json.loads(self.rfile.read(int(self.headers["Content-Length"]))))
        self.send_response(201)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture
def api() -> Iterator[str]:
    _Api.received = []
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Api)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def test_http_source_with_data_path_and_mapping_to_postgres_and_back_out_to_http(pg, api):
    outcome = transfer(
        {
            "source": {
                "type": "http",
                "url": f"{api}/users",
                "data_path": "data.items",
                "auth": {"token": "tok-s3cret-1"},
            },
            "target": {
                "type": "postgres",
                "auth": {"dsn": pg},
                "table": "dst",
                "mapping": {"id": "id", "name": "user.name"},
            },
            "chunk_size": 10,
        }
    )
    assert outcome.status == "ok", outcome.error
    assert (outcome.data["rows_transferred"], outcome.data["chunks_processed"]) == (25, 3)
    assert "tok-s3cret-1" in outcome.meta[SECRET_VALUES_META]
    assert "tok-s3cret-1" not in json.dumps(outcome.data)
    assert pg_rows(pg, "SELECT name FROM dst WHERE id = 25") == [("u25",)]
    sent = transfer(
        {
            "source": {"type": "postgres", "auth": {"dsn": pg}, "query": "SELECT id, name FROM dst ORDER BY id"},
            "target": {"type": "http", "url": f"{api}/sink"},
            "chunk_size": 20,
        }
    )
    assert sent.status == "ok", sent.error
    assert [len(body) for body in _Api.received] == [20, 5]
    assert _Api.received[1][-1] == {"id": 25, "name": "u25"}


def test_http_refusal_fails_naming_the_status(pg, api):
    outcome = transfer(
        {
            "source": {"type": "http", "url": f"{api}/users"},
            "target": {"type": "postgres", "auth": {"dsn": pg}, "table": "dst"},
        }
    )
    assert outcome.status == "error" and outcome.error["kind"] == "client_error" and not outcome.error["retryable"]
    assert "source (http)" in outcome.error["message"] and "HTTP 401" in outcome.error["message"]


def test_a_wrong_password_is_masked_and_not_retried(mysql_url):
    password = f"pw-{uuid.uuid4().hex}"
    outcome = transfer(
        {
            "source": {
                "type": "mysql",
                "auth": {"host": "127.0.0.1", "user": "nobody_here", "password": password},
                "query": "SELECT 1",
            },
            "target": {"type": "jsonl", "path": "/tmp/never.jsonl"},
        }
    )
    assert outcome.status == "error" and outcome.error["kind"] == "connection" and not outcome.error["retryable"]
    assert password not in json.dumps(outcome.to_dict()["error"]) and password in outcome.meta[SECRET_VALUES_META]


@pytest.mark.parametrize(
    ("config", "message"),
    [
        (
            {"source": {"type": "oracle", "query": "x"}, "target": {"type": "postgres", "table": "t"}},
            "source.type 'oracle' is not an endpoint",
        ),
        ({"source": {"type": "postgres"}, "target": {"type": "postgres", "table": "t"}}, "source.query is required"),
        ({"source": {"type": "postgres", "query": "x"}, "target": {"type": "mysql"}}, "target.table (or target.query"),
        (
            {
                "source": {"type": "postgres", "query": "x"},
                "target": {"type": "csv", "path": "/tmp/x.csv"},
                "mode": "upsert",
            },
            "mode upsert needs a database target",
        ),
        (
            {
                "source": {"type": "postgres", "query": "x"},
                "target": {"type": "postgres", "table": "t"},
                "mode": "sync",
            },
            "mode must be one of",
        ),
        (
            {
                "source": {"type": "postgres", "query": "x"},
                "target": {"type": "postgres", "table": "t"},
                "chunk_size": 0,
            },
            "chunk_size must be between",
        ),
        (
            {"source": {"type": "file", "path": "/tmp/x.bin"}, "target": {"type": "postgres", "table": "t"}},
            "source.format: say csv",
        ),
    ],
)
def test_bad_settings_are_refused_naming_the_field(config, message):
    outcome = transfer(config)
    assert outcome.status == "error" and outcome.error["kind"] == "invalid_args"
    assert message in outcome.error["message"], outcome.error["message"]


def test_a_mapping_naming_a_missing_field_is_refused(pg, tmp_path):
    outcome = transfer(
        {
            "source": {"type": "postgres", "auth": {"dsn": pg}, "query": "SELECT id FROM src"},
            "target": {"type": "jsonl", "path": str(tmp_path / "x.jsonl"), "mapping": {"a": "nope"}},
        }
    )
    assert outcome.status == "error" and "source field 'nope'" in outcome.error["message"]
    assert not Path(tmp_path / "x.jsonl").exists()


def playbook(source: str, target: str, mode: str = "append") -> str:
    return (
        "apiVersion: noetl.io/v10\nkind: Playbook\nmetadata: {name: t, path: tests/t}\nworkflow:\n"
        f"  - step: start\n    tool: {{kind: transfer, source: {source}, target: {target}, mode: {mode}}}\n"
    )


def test_validate_refuses_an_unknown_endpoint_type_and_mode_by_name():
    from noetl_celery.core.errors import PlaybookError
    from noetl_celery.dsl import load_plan

    with pytest.raises(PlaybookError) as raised:
        load_plan("t.yaml", text=playbook("{type: oracle, query: x}", "{type: postgres, table: t}", "sync"))
    text = str(raised.value)
    assert "source.type 'oracle' is not an endpoint this tool has" in text
    assert "mode must be one of append, insert, replace, upsert, not 'sync'" in text
    load_plan("t.yaml", text=playbook("{type: '{{ workload.kind }}', query: x}", "{type: postgres, table: t}"))


def test_a_missing_parquet_or_mysql_library_fails_validate_and_the_call_naming_the_extra(monkeypatch, tmp_path):
    from noetl_celery.core.errors import PlaybookError
    from noetl_celery.dsl import load_plan
    from noetl_celery.tools import base

    monkeypatch.setattr(base, "module_installed", lambda name: name not in ("pyarrow", "pymysql"))
    with pytest.raises(PlaybookError) as raised:
        load_plan("t.yaml", text=playbook("{type: mysql, query: x}", "{type: file, path: /tmp/out.parquet}"))
    text = str(raised.value)
    assert "pip install 'noetl_celery[mysql]'" in text and "pip install 'noetl_celery[parquet]'" in text
    outcome = transfer(
        {"source": {"type": "csv", "path": str(tmp_path / "a.csv")}, "target": {"type": "parquet", "path": "x.pq"}}
    )
    assert outcome.status == "error" and outcome.error["kind"] == "unknown_tool"
    assert "target format 'parquet' needs pyarrow" in outcome.error["message"]


def test_the_attempts_timeout_bounds_each_statement_and_rolls_back(pg):
    outcome = transfer(
        {
            "source": {"type": "postgres", "auth": {"dsn": pg}, "query": "SELECT id, name FROM src"},
            "target": {
                "type": "postgres",
                "auth": {"dsn": pg},
                "query": "INSERT INTO dst (id, name) SELECT %s, %s FROM pg_sleep(0.5)",
            },
            "chunk_size": 10,
        },
        timeout=0.3,
    )
    assert outcome.status == "error" and outcome.error["kind"] == "sql_error", outcome.error
    assert (
        "target (postgres): QueryCanceled" in outcome.error["message"]
        and "statement timeout" in outcome.error["message"]
    )
    assert pg_rows(pg, "SELECT count(*) FROM dst") == [(0,)]


class _Pipe(io.RawIOBase):
    """A readable stream that cannot seek (as an object store's download stream)."""

    def __init__(self, data: bytes) -> None:
        self.data = io.BytesIO(data)

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        return self.data.readinto(buffer)


@pytest.mark.parametrize("fmt", ["csv", "jsonl", "parquet"])
def test_a_registered_opener_serves_its_scheme_through_the_same_formats(pg, fmt, monkeypatch):
    objects: dict[str, bytes] = {}

    @contextlib.contextmanager
    def opener(location: str, mode: str, credential: Any) -> Iterator[Any]:
        assert credential == {"token": "object-store-token"}
        if mode == "rb":
            yield io.BufferedReader(_Pipe(objects[location]))
            return
        buffer = io.BytesIO()
        yield buffer
        objects[location] = buffer.getvalue()  # the object exists once it is whole

    monkeypatch.setattr(streams, "_OPENERS", {})  # registered for this test only
    streams.register_opener("mem", opener)
    location = f"mem://bucket/copy.{fmt}"
    auth = {"token": "object-store-token"}
    out = transfer(
        {
            "source": {"type": "postgres", "auth": {"dsn": pg}, "query": "SELECT id, name FROM src"},
            "target": {"type": "file", "path": location, "auth": auth},
            "chunk_size": 1000,
        }
    )
    assert out.status == "ok", out.error
    assert list(objects) == [location] and out.data["target_table"] == location
    back = transfer(
        {
            "source": {"type": "file", "path": location, "auth": auth},
            "target": {"type": "postgres", "auth": {"dsn": pg}, "table": "dst"},
        }
    )
    assert back.status == "ok", back.error
    assert back.data["rows_transferred"] == ROWS
    assert pg_rows(pg, "SELECT count(*), min(name), max(id) FROM dst") == [(ROWS, "n1", ROWS)]


def test_a_scheme_without_storage_is_refused_by_name(pg):
    outcome = transfer(
        {
            "source": {"type": "postgres", "auth": {"dsn": pg}, "query": "SELECT 1 AS x"},
            "target": {"type": "csv", "path": "nowhere://bucket/x.csv"},
        }
    )
    assert outcome.status == "error" and outcome.error["kind"] == "invalid_args"
    assert "no storage for nowhere:// locations" in outcome.error["message"]


def test_the_time_limit_inside_a_copy_is_a_timeout_and_rolls_the_chunk_back(pg, monkeypatch):
    from billiard.exceptions import SoftTimeLimitExceeded

    from noetl_celery.tools.transfer import databases

    real_write = databases.TableWriter._execute
    calls = []

    def write_then_limit(self: Any, cur: Any, rows: Any) -> None:
        real_write(self, cur, rows)
        calls.append(len(rows))
        if len(calls) == 2:
            raise SoftTimeLimitExceeded()

    monkeypatch.setattr(databases.TableWriter, "_execute", write_then_limit)
    outcome = transfer(
        {
            "source": {"type": "postgres", "auth": {"dsn": pg}, "query": "SELECT id, name FROM src ORDER BY id"},
            "target": {"type": "postgres", "auth": {"dsn": pg}, "table": "dst"},
            "chunk_size": 1000,
        },
        timeout=5.0,
    )
    assert outcome.status == "error" and outcome.error["kind"] == "timeout", outcome.error
    assert outcome.error["retryable"]
    assert pg_rows(pg, "SELECT count(*) FROM dst") == [(1000,)]  # the first chunk committed, the second not
