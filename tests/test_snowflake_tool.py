"""The snowflake tool with the real connector (snowflake-connector-python) against fakesnow's
server on a loopback port, the only local stand-in for Snowflake: NoETL's forms and result shape,
a failing statement, a refused login's secret masked; the playbook on the harness and once through
real worker processes on Redis + PostgreSQL."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

pytest.importorskip("snowflake.connector")
pytest.importorskip("fakesnow")

from noetl_celery.runner import wait  # noqa: E402
from noetl_celery.store.db import migrate  # noqa: E402
from noetl_celery.tools.base import ToolCall, run_tool  # noqa: E402
from tests.support.engines import submit  # noqa: E402
from tests.support.harness import run_playbook  # noqa: E402
from tests.support.services import free_port  # noqa: E402

PLAYBOOK = Path(__file__).resolve().parent / "playbooks" / "snowflake_tools.yaml"
PASSWORD = "sf-pw-5e1d-never-shown"


@pytest.fixture(scope="module")
def fakesnow_server(tmp_path_factory) -> Iterator[dict]:
    """`fakesnow -s` on a free loopback port; the credential that reaches it."""
    port = free_port()
    log = tmp_path_factory.mktemp("fakesnow") / "server.log"
    with open(log, "w") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "fakesnow", "-s", "--host", "127.0.0.1", "-p", str(port)], stdout=out, stderr=out
        )
    credential = {
        "account": "acct",
        "user": "svc",
        "password": PASSWORD,
        "host": "127.0.0.1",
        "port": port,
        "protocol": "http",
    }
    try:
        deadline = time.monotonic() + 30
        while "Uvicorn running" not in log.read_text() and time.monotonic() < deadline:
            assert proc.poll() is None, log.read_text()
            time.sleep(0.1)
        yield credential
    finally:
        proc.terminate()
        proc.wait(10)


def run(config: dict, credential: dict):  # type: ignore[no-untyped-def]
    return run_tool(ToolCall("snowflake", config, credential=credential))


def test_statements_run_in_order_with_noetls_result_shape(fakesnow_server) -> None:
    sql = (
        "create database if not exists unit; create schema if not exists unit.s; create or replace table unit.s.t (id int);"
        " insert into unit.s.t values (1), (2); select id from unit.s.t order by id"
    )
    outcome = run({"command": sql}, fakesnow_server)
    assert outcome.status == "ok", outcome.error
    assert sorted(outcome.data) == [f"statement_{i}" for i in range(5)]
    last = outcome.data["statement_4"]
    assert last == {
        "status": "success",
        "row_count": 2,
        "result": [{"ID": 1}, {"ID": 2}],
        "columns": ["ID"],
        "query": "select id from unit.s.t order by id",
    }


def test_a_failed_statement_fails_with_sql_error_and_the_rest_still_run(fakesnow_server) -> None:
    outcome = run(
        {
            "commands": [
                "create database if not exists unit",
                "select * from unit.public.no_such_table",
                "select 7 as x",
            ]
        },
        fakesnow_server,
    )
    assert outcome.error is not None and outcome.error["kind"] == "sql_error" and outcome.error["code"] == "42S02"
    assert outcome.error["message"].startswith("snowflake: statement_1 failed: 002003 (42S02)")
    assert outcome.data["statement_1"]["status"] == "error"
    assert outcome.data["statement_2"]["result"] == [{"X": 7}]


def test_bad_input_is_named(fakesnow_server) -> None:
    assert (
        run({"command_b64": "%%%"}, fakesnow_server)
        .error["message"]
        .startswith(  # type: ignore[index]
            "snowflake: command_b64 is not base64 of UTF-8 text"
        )
    )
    no_user = {k: v for k, v in fakesnow_server.items() if k != "user"}
    assert run({"command": "select 1"}, no_user).error["message"] == (  # type: ignore[index]
        "snowflake: the connection needs user (in the credential or on the task)"
    )
    unreachable = {**fakesnow_server, "port": free_port(), "login_timeout": 3}
    outcome = run({"command": "select 1"}, unreachable)
    assert outcome.error["kind"] == "connection" and outcome.error["retryable"] is True  # type: ignore[index]


def test_the_playbook_on_the_harness(fakesnow_server, tmp_path) -> None:
    env = {"NOETL_AUTH_SNOWFLAKE": json.dumps(fakesnow_server)}
    code, status = run_playbook(f"sqlite:///{tmp_path / 'h.sqlite'}", PLAYBOOK, None, env)
    assert code == 0, status.get("error")
    assert status["results"]["end"] == {"first_note": "a; b", "total": 14.75}
    assert PASSWORD not in json.dumps(status)


def test_the_playbook_on_real_workers(fakesnow_server, worker_factory, redis_url, postgres_url) -> None:
    migrate(postgres_url)
    env = {"NOETL_BROKER_URL": redis_url, "NOETL_DATABASE_URL": postgres_url}
    worker_factory(env={**env, "NOETL_AUTH_SNOWFLAKE": json.dumps(fakesnow_server)}, concurrency=2, name="snowflake@%h")
    execution_id = submit(env, PLAYBOOK)
    status = wait(postgres_url, execution_id, timeout=90)
    assert status["status"] == "completed", status
    from noetl_celery.store import repo
    from noetl_celery.store.db import transaction

    with transaction(postgres_url) as conn:
        events = repo.list_events(conn, execution_id)
    ends = [e for e in events if e["step"] == "end" and e["event_type"] == "action.completed"]
    assert ends and ends[0]["result"] == {"first_note": "a; b", "total": 14.75}
    assert PASSWORD not in json.dumps(events, default=str)
