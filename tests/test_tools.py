"""Tools against real things: inline Python, a local HTTP server, a local PostgreSQL."""

from __future__ import annotations

import json
import os
import time
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from http.server import BaseHTTPRequestHandler
from typing import Any
from urllib.parse import parse_qs, urlsplit

import pytest

from noetl_celery.core.sql_result import both_forms
from noetl_celery.tools.base import Outcome, ToolCall, get_tool, run_tool
from tests.support.loopback import serve


def last_rows(outcome: Outcome) -> Any:
    """The rows of a SQL outcome's last statement, whichever form it was stored in."""
    return both_forms(outcome.data)["rows"]


PG_DSN = os.environ.get("NOETL_TEST_PG_DSN", "postgresql://postgres@127.0.0.1:5432/postgres")


def call(kind: str, credential: Any = None, context: dict[str, Any] | None = None, **config: Any) -> Outcome:
    """Run one tool call; `call_timeout` becomes ToolCall.timeout, the rest is the config."""
    timeout = config.pop("call_timeout", None)
    return run_tool(ToolCall(kind=kind, config=config, credential=credential, context=context or {}, timeout=timeout))


# ---------------------------------------------------------------- python


def test_python_async_main_legacy_hello_world(capsys: pytest.CaptureFixture[str]) -> None:
    code = (
        "async def main(message):\n"
        "    print(f'HELLO_WORLD: {message}')\n"
        "    return {'status': 'success', 'data': {'message': message}}\n"
    )
    out = call("python", code=code, args={"message": "Hello World"})
    assert out.status == "ok"
    assert out.data == {"status": "success", "data": {"message": "Hello World"}}  # not unwrapped
    assert out.meta["stdout"] == "HELLO_WORLD: Hello World\n"
    assert "HELLO_WORLD" not in capsys.readouterr().out


def test_python_script_style_binds_args_input_data_and_context() -> None:
    code = (
        "print(f'HELLO_WORLD: {message}')\n"
        "result = {'msg': message, 'keys': sorted(input_data), 'item': context.get('item')}\n"
    )
    out = call("python", code=code, args={"message": "hi", "n": 1}, context={"item": 7})
    assert out.status == "ok"
    assert out.data == {"msg": "hi", "keys": ["message", "n"], "item": 7}
    assert out.meta["stdout"] == "HELLO_WORLD: hi\n"


def test_python_script_without_result_gives_none_and_input_alias() -> None:
    assert call("python", code="x = 1\n").data is None
    assert call("python", code="result = a + 1", input={"a": 41}).data == 42


def test_python_main_context_parameter_from_loop() -> None:
    code = (
        "def main(context):\n"
        "    item = context.get('item', {})\n"
        "    return {'item_name': item.get('name', 'unknown'), 'item_value': item.get('value', 0)}\n"
    )
    out = call("python", code=code, context={"item": {"name": "item1", "value": 100}})
    assert out.data == {"item_name": "item1", "item_value": 100}


def test_python_main_input_data_parameter() -> None:
    code = "def main(input_data):\n    return sorted(input_data)\n"
    assert call("python", code=code, args={"b": 1, "a": 2}).data == ["a", "b"]
    # an arg literally named input_data wins (legacy pagination playbooks pass it that way)
    code2 = "def main(input_data):\n    return input_data.get('pages', [])\n"
    assert call("python", code=code2, args={"input_data": {"pages": [1, 2]}}).data == [1, 2]


def test_python_main_extra_args_ignored_defaults_and_kwargs() -> None:
    assert call("python", code="def main(a, b=2):\n    return a + b", args={"a": 1, "zz": 0}).data == 3
    assert call("python", code="def main(a, **kw):\n    return sorted(kw)", args={"a": 1, "x": 2}).data == ["x"]


def test_python_missing_required_parameters_named() -> None:
    out = call("python", code="def main(loop_results, workload):\n    return 1\n", args={"workload": {}})
    assert out.status == "error"
    assert out.error["kind"] == "invalid_args"
    assert "loop_results" in out.error["message"] and "workload" not in out.error["missing"]


def test_python_exception_message_has_line_and_type() -> None:
    code = "def main():\n    x = 1\n    raise ValueError('boom')\n"
    out = call("python", code=code)
    assert out.status == "error"
    assert out.error["kind"] == "exception"
    assert out.error["message"] == "ValueError: boom (line 3 of the code)"
    assert "raise ValueError('boom')" in out.error["traceback"]
    assert "tools/python.py" not in out.error["traceback"]
    script = call("python", code="a = 1\nresult = {}['missing']\n")
    assert script.error["message"] == "KeyError: 'missing' (line 2 of the code)"


def test_python_stdout_kept_on_error_and_truncated() -> None:
    out = call("python", code="print('before')\nraise RuntimeError('x')\n")
    assert out.status == "error" and out.meta["stdout"] == "before\n"
    big = call("python", code="print('y' * 10000)\nresult = 1\n")
    assert len(big.meta["stdout"]) == 4000


def test_python_stderr_and_log_records_are_captured_per_thread(capfd: pytest.CaptureFixture[str]) -> None:
    """stdout, stderr and logging records of each attempt's code land in its own outcome, also
    when attempts run at once on threads; nothing reaches the process's own stderr."""
    code = (
        "import logging, sys\n"
        "print('out', n)\n"
        "print('err', n, file=sys.stderr)\n"
        "logging.getLogger('mine').warning('warned %s', n)\n"
        "for i in range(150):\n"
        "    logging.getLogger('mine').error('flood %s', i)\n"
        "if n % 2:\n"
        "    raise ValueError(n)\n"
        "result = n\n"
    )
    with ThreadPoolExecutor(4) as pool:
        outs = list(pool.map(lambda n: call("python", code=code, args={"n": n}), range(8)))
    for n, out in enumerate(outs):
        assert out.status == ("error" if n % 2 else "ok")
        assert out.meta["stdout"] == f"out {n}\n" and out.meta["stderr"] == f"err {n}\n"
        log = out.meta["log"]
        assert log[0] == f"WARNING mine: warned {n}" and log[1] == "ERROR mine: flood 0"
        assert len(log) == 101 and log[-1] == "... 51 more records not kept"  # bounded
        assert all(f"warned {m}" not in "\n".join(log) for m in range(8) if m != n)
    assert "err " not in capfd.readouterr().err


def test_python_syntax_error_and_sys_exit() -> None:
    out = call("python", code="def main(:\n  pass\n")
    assert out.status == "error" and out.error["message"].startswith("SyntaxError") and "line 1" in out.error["message"]
    out = call("python", code="import sys\nsys.exit(3)\n")
    assert out.status == "error" and out.error["message"].startswith("SystemExit")


def test_python_values_made_jsonable() -> None:
    code = (
        "import datetime, decimal, uuid\n"
        "result = {'t': (1, 2), 's': {3}, 'd': decimal.Decimal('1.5'), 'i': decimal.Decimal('10'),\n"
        "          'when': datetime.date(2026, 1, 2), 'u': uuid.UUID(int=1), 'b': b'hi'}\n"
    )
    data = call("python", code=code).data
    assert data == {
        "t": [1, 2],
        "s": [3],
        "d": 1.5,
        "i": 10,
        "when": "2026-01-02",
        "u": "00000000-0000-0000-0000-000000000001",
        "b": "hi",
    }
    json.dumps(data)


def test_python_top_level_await_and_compile_cache() -> None:
    from noetl_celery.tools import python as py

    code = "import asyncio\nawait asyncio.sleep(0)\nresult = n * 2\n"
    assert call("python", code=code, args={"n": 2}).data == 4
    before = py._compile.cache_info().hits
    assert call("python", code=code, args={"n": 3}).data == 6
    assert py._compile.cache_info().hits == before + 1


def test_registry_shapes() -> None:
    assert get_tool("python").raw_fields == {"code"}
    assert get_tool("end").routing_only and get_tool("router").routing_only
    assert get_tool("log").kind == "event_log"
    assert frozenset({"url", "endpoint"}) in get_tool("http").required


# ---------------------------------------------------------------- noop / event_log


def test_noop_and_event_log() -> None:
    assert call("noop").data is None
    assert call("end", args={"a": 1}).data == {"a": 1}
    out = call("event_log", args={"status": "success", "message": "Hello"})
    assert out.status == "ok" and out.data == {"event_log": {"status": "success", "message": "Hello"}}
    out = call("log", args={"x": 1}, message="m", status="done")
    assert out.data == {"event_log": {"x": 1, "message": "m", "status": "done"}}


# ---------------------------------------------------------------- http


class _Handler(BaseHTTPRequestHandler):
    seen: list[dict[str, Any]] = []

    def log_message(self, *args: Any) -> None:  # keep the test output quiet
        pass

    def _reply(self, status: int, body: bytes, content_type: str, extra: dict[str, str] | None = None) -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.send_header("X-Custom", "Yes")
        for k, v in (extra or {}).items():
            self.send_header(k, v)
        self.end_headers()
        self.wfile.write(body)

    def _handle(self) -> None:
        parts = urlsplit(self.path)
        length = int(self.headers.get("Content-Length") or 0)
        body = self.rfile.read(length) if length else b""
        _Handler.seen.append(
            {
                "method": self.command,
                "path": parts.path,
                "query": parse_qs(parts.query),
                "headers": dict(self.headers),
                "body": body,
            }
        )
        if parts.path == "/json":
            self._reply(200, json.dumps({"ok": True, "q": parse_qs(parts.query)}).encode(), "application/json")
        elif parts.path == "/text":
            self._reply(200, b"plain text", "text/plain")
        elif parts.path == "/echo":
            self._reply(200, body or b"{}", "application/json")
        elif parts.path == "/limited":
            self._reply(429, b'{"error": "slow down"}', "application/json", {"Retry-After": "7"})
        elif parts.path == "/boom":
            self._reply(500, b"internal", "text/plain")
        elif parts.path == "/denied":
            self._reply(403, b"no", "text/plain")
        elif parts.path == "/slow":
            time.sleep(1.5)
            self._reply(200, b"late", "text/plain")
        else:
            self._reply(404, b'{"detail": "missing"}', "application/json")

    do_GET = do_POST = do_PUT = do_DELETE = _handle


@pytest.fixture(scope="module")
def server() -> Iterator[str]:
    with serve(_Handler) as url:
        yield url


def test_http_get_json(server: str) -> None:
    out = call("http", url=f"{server}/json", params={"page": 2, "flag": True})
    assert out.status == "ok"
    assert out.data["status_code"] == 200
    assert out.data["data"] == {"ok": True, "q": {"page": ["2"], "flag": ["true"]}}
    assert out.data["headers"]["x-custom"] == "Yes"
    assert out.data["url"].startswith(f"{server}/json?")
    assert isinstance(out.data["elapsed"], float)
    assert out.http == {"status": 200, "headers": out.data["headers"]}
    json.dumps(out.to_dict())


def test_http_text_body_and_endpoint_alias(server: str) -> None:
    out = call("http", endpoint=f"{server}/text")
    assert out.status == "ok" and out.data["data"] == "plain text"


def test_http_post_payload_is_json_and_get_payload_is_query(server: str) -> None:
    out = call("http", method="post", url=f"{server}/echo", payload={"a": [1, 2]})
    assert out.data["data"] == {"a": [1, 2]}
    assert _Handler.seen[-1]["headers"]["Content-Type"] == "application/json"
    out = call("http", url=f"{server}/json", payload={"page": 3})
    assert out.data["data"]["q"] == {"page": ["3"]}
    out = call("http", method="PUT", url=f"{server}/echo", body="raw-text")
    assert _Handler.seen[-1]["body"] == b"raw-text" and out.data["data"] == "raw-text"


@pytest.mark.parametrize(
    ("path", "kind", "retryable", "status"),
    [
        ("/nothing", "not_found", False, 404),
        ("/limited", "rate_limit", True, 429),
        ("/boom", "server_error", True, 500),
        ("/denied", "auth", False, 403),
    ],
)
def test_http_error_statuses(server: str, path: str, kind: str, retryable: bool, status: int) -> None:
    out = call("http", url=f"{server}{path}")
    assert out.status == "error"
    assert out.error["kind"] == kind and out.error["retryable"] is retryable and out.error["status"] == status
    assert out.http["status"] == status
    assert out.data["status_code"] == status  # the response is still there
    if status == 429:
        assert out.error["retry_after"] == 7.0 and out.data["data"] == {"error": "slow down"}
    else:
        assert "retry_after" not in out.error
    if status == 404:
        assert out.data["data"] == {"detail": "missing"}


def test_http_bearer_credential_reaches_server_not_outcome(server: str) -> None:
    token = "s3cr3t-token-value"
    out = call("http", credential={"type": "bearer", "token": token}, url=f"{server}/json", headers={"X-Trace": "1"})
    assert out.status == "ok"
    seen = _Handler.seen[-1]["headers"]
    assert seen["Authorization"] == f"Bearer {token}" and seen["X-Trace"] == "1"
    assert token not in json.dumps(out.to_dict())
    denied = call("http", credential={"type": "bearer", "token": token}, url=f"{server}/denied")
    assert token not in json.dumps(denied.to_dict())


def test_http_other_credential_shapes(server: str) -> None:
    call("http", credential={"type": "basic", "username": "u", "password": "p"}, url=f"{server}/json")
    assert _Handler.seen[-1]["headers"]["Authorization"] == "Basic dTpw"
    call("http", credential={"type": "api_key", "name": "X-Api-Key", "value": "k123"}, url=f"{server}/json")
    assert _Handler.seen[-1]["headers"]["X-Api-Key"] == "k123"
    call("http", credential={"headers": {"X-One": "1"}}, url=f"{server}/json")
    assert _Handler.seen[-1]["headers"]["X-One"] == "1"
    bad = call("http", credential={"type": "oauth9", "secret": "zzzz"}, url=f"{server}/json")
    assert bad.status == "error" and bad.error["kind"] == "credential" and "zzzz" not in bad.error["message"]


def test_http_timeout_and_connection_error(server: str) -> None:
    out = call("http", url=f"{server}/slow", call_timeout=0.3)
    assert out.status == "error" and out.error["kind"] == "timeout" and out.error["retryable"] is True
    out = call("http", url=f"{server}/slow", timeout=0.2, call_timeout=5)  # the call's timeout wins
    assert out.status == "ok"
    out = call("http", url="http://127.0.0.1:9/nothing", timeout=2)
    assert out.status == "error" and out.error["kind"] == "connection" and out.error["retryable"] is True


# ---------------------------------------------------------------- postgres


def _pg_available() -> bool:
    try:
        import psycopg2

        psycopg2.connect(PG_DSN, connect_timeout=3).close()
        return True
    except Exception:
        return False


@pytest.fixture(scope="module")
def pg() -> Iterator[tuple[str, str]]:
    """(DSN, throw-away schema name); skipped when PostgreSQL is not reachable (fails on CI)."""
    if not _pg_available():
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail(f"PostgreSQL not reachable at {PG_DSN} (CI=true)")
        pytest.skip(f"PostgreSQL not reachable at {PG_DSN}")
    import psycopg2

    schema = f"noetl_test_{uuid.uuid4().hex[:12]}"
    conn = psycopg2.connect(PG_DSN)
    conn.autocommit = True
    conn.cursor().execute(f'CREATE SCHEMA "{schema}"')
    try:
        yield PG_DSN, schema
    finally:
        conn.cursor().execute(f'DROP SCHEMA "{schema}" CASCADE')
        conn.close()


def test_postgres_bind_params_and_types(pg: tuple[str, str]) -> None:
    dsn, _ = pg
    out = call(
        "postgres",
        credential=dsn,
        query="SELECT %(n)s::int + 1 AS n, %(s)s AS s, 1.50::numeric AS d, '2026-01-02'::date AS day, "
        "gen_random_uuid() IS NOT NULL AS ok, '{\"a\": 1}'::jsonb AS j",
        params={"n": 41, "s": "x"},
    )
    assert out.status == "ok", out.error
    assert last_rows(out) == [{"n": 42, "s": "x", "d": 1.5, "day": "2026-01-02", "ok": True, "j": {"a": 1}}]
    assert out.data["columns"] == ["n", "s", "d", "day", "ok", "j"]
    assert out.data["row_count"] == 1 and out.data["statusmessage"] == "SELECT 1"
    json.dumps(out.to_dict())
    # no params: a literal % is fine
    assert call("postgres", credential=dsn, sql="SELECT '100%' AS p").data["rows"] == [{"p": "100%"}]


def test_postgres_multi_statement_and_do_block(pg: tuple[str, str]) -> None:
    dsn, schema = pg
    text = f"""
        CREATE TABLE {schema}.t (id SERIAL PRIMARY KEY, v TEXT);
        INSERT INTO {schema}.t (v) VALUES ('a'), ('b');
        DO $$ BEGIN
          INSERT INTO {schema}.t (v) VALUES ('from-do');
        END $$;
        SELECT 'Table ready' AS status, count(*) AS n FROM {schema}.t;
    """
    out = call("postgres", credential=dsn, command=text)
    assert out.status == "ok", out.error
    assert last_rows(out) == [{"status": "Table ready", "n": 3}]
    ddl = call("postgres", credential={"dsn": dsn}, command=f"CREATE TABLE {schema}.empty (x int)")
    assert last_rows(ddl) == [] and ddl.data["columns"] == [] and ddl.data["statusmessage"] == "CREATE TABLE"


def test_postgres_upsert_sink_shape_with_json(pg: tuple[str, str]) -> None:
    dsn, schema = pg
    create = (
        f"CREATE TABLE {schema}.items (id TEXT PRIMARY KEY, item_name TEXT, item_value INTEGER, "
        "meta JSONB, created_at TIMESTAMPTZ DEFAULT now())"
    )
    assert call("postgres", credential=dsn, command=create).status == "ok"
    table = f"{schema}.items"
    first = call(
        "postgres",
        credential=dsn,
        table=table,
        mode="upsert",
        key="id",
        args={"id": "e:item1", "item_name": "item1", "item_value": "100", "meta": {"tags": ["a"]}},
    )
    assert first.status == "ok", first.error
    assert first.data == {"row_count": 1, "table": table, "mode": "upsert"}
    again = call(
        "postgres",
        credential=dsn,
        table=table,
        mode="upsert",
        key=["id"],
        args=[
            {"id": "e:item1", "item_name": "item1", "item_value": 150, "meta": [1, 2]},
            {"id": "e:item2", "item_name": "item2", "item_value": 200, "meta": None},
        ],
    )
    assert again.status == "ok" and again.data["row_count"] == 2
    appended = call("postgres", credential=dsn, table=table, mode="append", args={"id": "e:item3", "item_value": 3})
    assert appended.status == "ok"
    rows = call(
        "postgres",
        credential=dsn,
        query=f"SELECT id, item_value, meta, created_at IS NOT NULL AS c FROM {table} ORDER BY id",
    ).data["rows"]
    assert rows == [
        {"id": "e:item1", "item_value": 150, "meta": [1, 2], "c": True},
        {"id": "e:item2", "item_value": 200, "meta": None, "c": True},
        {"id": "e:item3", "item_value": 3, "meta": None, "c": True},
    ]
    dup = call("postgres", credential=dsn, table=table, mode="insert", args={"id": "e:item3"})
    assert dup.status == "error" and dup.error["code"] == "23505" and dup.pg == {"code": "23505"}
    nokey = call("postgres", credential=dsn, table=table, mode="upsert", args={"id": "x"})
    assert nokey.status == "error" and nokey.error["kind"] == "invalid_args"


def test_postgres_sql_error_has_sqlstate_and_names_the_statement(pg: tuple[str, str]) -> None:
    dsn, schema = pg
    out = call("postgres", credential=dsn, command="SELECT \n  COUNT(*) as row_count,\nFROM patient_info;")
    assert out.status == "error"
    assert out.error["kind"] == "sql_error" and out.error["code"] == "42601" and out.pg == {"code": "42601"}
    assert out.error["retryable"] is False and out.error["message"].startswith("ERROR:  syntax error")  # one statement
    # each statement commits on its own: the one before the failure stays, the one after never runs
    bad = call(
        "postgres",
        credential=dsn,
        command=f"CREATE TABLE {schema}.kept (x int); SELECT 1/0; CREATE TABLE {schema}.never (x int);",
    )
    assert bad.error["code"] == "22012" and bad.error["message"].startswith(
        "statement 2 of 3: ERROR:  division by zero"
    )
    check = call(
        "postgres",
        credential=dsn,
        query=f"SELECT to_regclass('{schema}.kept') IS NOT NULL AS kept, to_regclass('{schema}.never') AS never",
    )
    assert last_rows(check) == [{"kept": True, "never": None}]


def test_postgres_begin_commit_in_the_text_is_one_transaction(pg: tuple[str, str]) -> None:
    dsn, schema = pg
    failed = call(
        "postgres",
        credential=dsn,
        command=f"BEGIN; CREATE TABLE {schema}.gone (x int); INSERT INTO {schema}.gone VALUES (1/0); COMMIT;",
    )
    assert failed.error["code"] == "22012" and failed.error["message"].startswith("statement 3 of 4:")
    left_open = call("postgres", credential=dsn, command=f"BEGIN; CREATE TABLE {schema}.open (x int);")
    assert left_open.error["kind"] == "invalid_args" and "BEGIN without COMMIT" in left_open.error["message"]
    # both were rolled back, and the cached connection is usable (not stuck in a transaction)
    check = call(
        "postgres",
        credential=dsn,
        query=f"SELECT to_regclass('{schema}.gone') AS gone, to_regclass('{schema}.open') AS open",
    )
    assert last_rows(check) == [{"gone": None, "open": None}]
    ok = call(
        "postgres",
        credential=dsn,
        command=f"BEGIN; CREATE TABLE {schema}.both (x int); INSERT INTO {schema}.both VALUES (7); COMMIT; "
        f"SELECT x FROM {schema}.both",
    )
    assert ok.status == "ok", ok.error
    assert last_rows(ok) == [{"x": 7}]
    empty = call("postgres", credential=dsn, command=" ; -- nothing\n /* at all */ ;")
    assert empty.error["kind"] == "invalid_args" and "no statement" in empty.error["message"]


def test_postgres_statements_of_concurrent_texts_see_each_others_commits(pg: tuple[str, str]) -> None:
    """The barrier pattern of NoETL playbooks: each text inserts its row, then counts the rows.

    Run in one transaction, two overlapping texts would each count only their own row and neither
    would pass the barrier; committed statement by statement, the later count sees both."""
    dsn, schema = pg
    assert call("postgres", credential=dsn, command=f"CREATE TABLE {schema}.barrier (k int PRIMARY KEY)").status == "ok"
    text = (
        f"INSERT INTO {schema}.barrier VALUES (%(k)s); SELECT pg_sleep(0.5); SELECT count(*) AS n FROM {schema}.barrier"
    )
    with ThreadPoolExecutor(2) as pool:
        outs = list(pool.map(lambda k: call("postgres", credential=dsn, command=text, params={"k": k}), [1, 2]))
    assert [o.status for o in outs] == ["ok", "ok"], [o.error for o in outs]
    assert [last_rows(o) for o in outs] == [[{"n": 2}], [{"n": 2}]]


def test_postgres_timeout_applies_to_every_statement(pg: tuple[str, str]) -> None:
    dsn, _ = pg
    slow = call("postgres", credential=dsn, command="SELECT 1; SELECT pg_sleep(2)", call_timeout=0.3)
    assert slow.error["code"] == "57014" and slow.error["message"].startswith("statement 2 of 2:")
    # the next call without a timeout is not held to the last one's
    assert call("postgres", credential=dsn, command="SELECT 1 AS slept FROM pg_sleep(0.5)").data["rows"] == [
        {"slept": 1}
    ]


def test_postgres_env_dsn_and_missing_credential(pg: tuple[str, str], monkeypatch: pytest.MonkeyPatch) -> None:
    dsn, _ = pg
    monkeypatch.setenv("NOETL_POSTGRES_DSN", dsn)
    assert call("postgres", query="SELECT 1 AS one").data["rows"] == [{"one": 1}]
    monkeypatch.delenv("NOETL_POSTGRES_DSN")
    out = call("postgres", query="SELECT 1")
    assert out.status == "error" and out.error["kind"] == "credential" and "NOETL_POSTGRES_DSN" in out.error["message"]


def test_postgres_connection_error_hides_password(pg: tuple[str, str]) -> None:
    password = "Very-Secret-Pw-123"
    out = call(
        "postgres",
        credential={
            "host": "127.0.0.1",
            "port": 5432,
            "user": f"no_{password}",
            "password": password,
            "database": "postgres",
        },
        query="SELECT 1",
    )
    assert out.status == "error" and out.error["kind"] == "connection"
    assert out.error["retryable"] is False  # a wrong role does not heal by waiting
    assert password not in json.dumps(out.to_dict())
    refused = call("postgres", credential=f"postgresql://u:{password}@127.0.0.1:1/postgres", query="SELECT 1")
    assert refused.error["kind"] == "connection" and refused.error["retryable"] is True
    assert password not in json.dumps(refused.to_dict())
