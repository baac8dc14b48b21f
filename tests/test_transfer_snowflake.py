"""The transfer tool's snowflake endpoint with the real connector against fakesnow's server on a
loopback port, and a real local PostgreSQL: Snowflake -> PostgreSQL read in chunks, PostgreSQL
-> Snowflake written by batched INSERT and by MERGE (upsert, run twice without duplicates),
NoETL's custom MERGE target query, and the credential's secrets handed to the masking."""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg2
import pytest

pytest.importorskip("snowflake.connector")
pytest.importorskip("fakesnow")

from noetl_celery.tools.base import SECRET_VALUES_META, ToolCall, run_tool  # noqa: E402
from tests.test_snowflake_tool import PASSWORD, fakesnow_server  # noqa: E402,F401  (the fixture)

ROWS = 25


def transfer(config: dict[str, Any]) -> Any:
    return run_tool(ToolCall(kind="transfer", config=config))


def snowflake(sql: str, credential: dict) -> Any:
    outcome = run_tool(ToolCall("snowflake", {"command": sql}, credential=credential))
    assert outcome.status == "ok", outcome.error
    return outcome.data


def pg_rows(dsn: str, sql: str) -> list[tuple]:
    with psycopg2.connect(dsn) as conn, conn.cursor() as cur:
        cur.execute(sql)
        return cur.fetchall()


@pytest.fixture
def sf(fakesnow_server) -> Iterator[dict]:  # noqa: F811
    """A Snowflake database of this test's own with SRC (ROWS rows) and an empty DST; the
    credential pointing at it."""
    database = f"T_{uuid.uuid4().hex[:8]}".upper()
    snowflake(
        f"create database {database}; create schema {database}.s;"
        f" create table {database}.s.src (id int primary key, name varchar, amount numeric(10,2));"
        f" insert into {database}.s.src select seq4() + 1, 'n' || (seq4() + 1), (seq4() + 1) * 1.5"
        f" from table(generator(rowcount => {ROWS}));"
        f" create table {database}.s.dst (id int primary key, name varchar, amount numeric(10,2))",
        fakesnow_server,
    )
    yield {**fakesnow_server, "database": database, "schema": "S"}


@pytest.fixture
def pg(fresh_postgres) -> str:
    with psycopg2.connect(fresh_postgres.dsn) as conn, conn.cursor() as cur:
        cur.execute("CREATE TABLE src (id int PRIMARY KEY, name text, amount numeric(10,2))")
        cur.execute("INSERT INTO src SELECT i, 'p' || i, i * 2.5 FROM generate_series(1, %s) i", [ROWS])
        cur.execute("CREATE TABLE dst (id int PRIMARY KEY, name text, amount numeric(10,2))")
    return fresh_postgres.dsn


def sf_rows(credential: dict, sql: str) -> list[dict]:
    return snowflake(sql, credential)["statement_0"]["result"]


def test_snowflake_to_postgres_in_chunks(sf, pg) -> None:
    outcome = transfer(
        {
            "source": {"type": "snowflake", "auth": sf, "query": "SELECT id, name, amount FROM src ORDER BY id"},
            "target": {"type": "postgres", "auth": {"dsn": pg}, "table": "public.dst"},
            "chunk_size": 10,
        }
    )
    assert outcome.status == "ok", outcome.error
    data = outcome.data
    assert data["direction"] == "snowflake_to_postgres" and data["rows_transferred"] == ROWS
    assert data["chunks_processed"] == 3 and data["columns"] == ["id", "name", "amount"]  # lower-cased, as NoETL
    assert pg_rows(pg, "SELECT count(*), sum(amount), max(name) FROM dst") == [(ROWS, pytest.approx(487.5), "n9")]
    assert PASSWORD in outcome.meta[SECRET_VALUES_META]  # the worker masks it wherever it shows


def test_postgres_to_snowflake_by_batched_insert(sf, pg) -> None:
    outcome = transfer(
        {
            "source": {"type": "postgres", "auth": {"dsn": pg}, "query": "SELECT * FROM src ORDER BY id"},
            "target": {"type": "snowflake", "auth": sf, "table": "dst"},
            "chunk_size": 7,
        }
    )
    assert outcome.status == "ok", outcome.error
    assert outcome.data["rows_transferred"] == ROWS and outcome.data["chunks_processed"] == 4
    assert sf_rows(sf, "select count(*) as n, sum(amount) as total from dst") == [{"N": ROWS, "TOTAL": 812.5}]


def test_upsert_into_snowflake_twice_writes_each_row_once_and_updates(sf, pg) -> None:
    config = {
        "source": {"type": "postgres", "auth": {"dsn": pg}, "query": "SELECT id, name, amount FROM src"},
        "target": {"type": "snowflake", "auth": sf, "table": "dst"},
        "mode": "upsert",
        "key": "id",
        "chunk_size": 10,
    }
    first = transfer(config)
    assert first.status == "ok", first.error
    pg_rows(pg, "UPDATE src SET name = 'changed' WHERE id = 3 RETURNING id")
    again = transfer(config)  # a retry of the step: the MERGE writes each keyed row once
    assert again.status == "ok", again.error
    assert sf_rows(sf, "select count(*) as n, count(distinct id) as ids from dst") == [{"N": ROWS, "IDS": ROWS}]
    assert sf_rows(sf, "select name from dst where id = 3") == [{"NAME": "changed"}]


def test_noetls_custom_merge_target_query(sf, pg) -> None:
    merge = (
        "MERGE INTO dst AS target USING (SELECT %s AS id, %s AS name, %s AS amount) AS source"
        " ON target.id = source.id WHEN MATCHED THEN UPDATE SET name = source.name, amount = source.amount"
        " WHEN NOT MATCHED THEN INSERT (id, name, amount) VALUES (source.id, source.name, source.amount)"
    )
    config = {
        "source": {"type": "postgres", "auth": {"dsn": pg}, "query": "SELECT * FROM src WHERE id <= 5 ORDER BY id"},
        "target": {"type": "snowflake", "auth": sf, "query": merge},
    }
    for _ in range(2):
        outcome = transfer(config)
        assert outcome.status == "ok", outcome.error
        assert outcome.data["target_table"] == "custom_query" and outcome.data["rows_transferred"] == 5
    assert sf_rows(sf, "select count(*) as n from dst") == [{"N": 5}]


def test_replace_and_a_failed_source_query(sf, pg) -> None:
    snowflake("insert into dst values (999, 'old', 1)", sf)
    outcome = transfer(
        {
            "source": {"type": "postgres", "auth": {"dsn": pg}, "query": "SELECT * FROM src"},
            "target": {"type": "snowflake", "auth": sf, "table": "dst"},
            "mode": "replace",
        }
    )
    assert outcome.status == "ok", outcome.error
    assert sf_rows(sf, "select count(*) as n, max(id) as top from dst") == [{"N": ROWS, "TOP": ROWS}]
    failed = transfer(
        {
            "source": {"type": "snowflake", "auth": sf, "query": "select * from no_such_table"},
            "target": {"type": "postgres", "auth": {"dsn": pg}, "table": "dst"},
        }
    )
    assert failed.error["kind"] == "sql_error" and failed.error["message"].startswith(  # type: ignore[index]
        "transfer: source (snowflake): ProgrammingError"
    )


def test_a_snowflake_endpoint_without_a_user_is_named(sf, pg) -> None:
    no_user = {k: v for k, v in sf.items() if k != "user"}
    outcome = transfer(
        {
            "source": {"type": "snowflake", "auth": no_user, "query": "select 1"},
            "target": {"type": "postgres", "auth": {"dsn": pg}, "table": "dst"},
        }
    )
    assert outcome.error["kind"] == "invalid_args"  # type: ignore[index]
    assert "source: snowflake: the connection needs user" in outcome.error["message"]  # type: ignore[index]


def test_noetls_snowflake_postgres_playbook_runs_both_ways(sf, fresh_postgres, tmp_path) -> None:
    """NoETL's own fixture, whole: Snowflake -> PostgreSQL through a custom ON CONFLICT upsert
    (VARIANT and TIMESTAMP_TZ values included), PostgreSQL -> Snowflake through a custom MERGE."""
    from tests.support.harness import run_playbook

    playbook = Path(__file__).parent / "corpus" / "noetl-public" / "tools" / "snowflake_postgres.yaml"
    env = {
        "NOETL_AUTH_SF_TEST": json.dumps({**sf, "database": "TEST_DB", "schema": "PUBLIC"}),
        "NOETL_AUTH_PG_LOCAL": fresh_postgres.dsn,
    }
    code, status = run_playbook(f"sqlite:///{tmp_path / 'h.sqlite'}", playbook, None, env)
    assert code == 0, status.get("error")
    results = status["results"]
    assert results["transfer_sf_to_pg"]["rows_transferred"] == 5
    assert results["transfer_pg_to_sf"]["rows_transferred"] == 5
    assert pg_rows(
        fresh_postgres.dsn, "SELECT count(*), sum(value)::text, min(metadata->>'type') FROM test_data_transfer"
    ) == [(5, "1502.49", "test")]
    verified = results["verify_sf_data"]["statement_0"]["result"]
    assert verified == [{"ROW_COUNT": 5, "MIN_ID": 101, "MAX_ID": 105, "TOTAL_AMOUNT": pytest.approx(15002.49)}]
    assert PASSWORD not in json.dumps(status, default=str)
