"""The data tools as NoETL playbooks use them, on a real PostgreSQL and an embedded DuckDB:
postgres `credential:`/`pool:`/`script:` and the `command_0` result, the duckdb tool, the
secrets tool. Calls go through the worker's own path (render, credential, settings, tool)."""

from __future__ import annotations

import json
import uuid
from pathlib import Path

import psycopg2
import pytest

from noetl_celery.config import credentials
from noetl_celery.core.sql_result import both_forms
from noetl_celery.dsl import load_plan
from noetl_celery.engine.attempt import worker
from noetl_celery.tools.base import Outcome
from tests.test_tool_settings import V2, compile_text, one_step, problems


def call(
    kind: str,
    config: dict,
    *,
    auth=None,
    context=None,
    secrets=None,
    execution_id=1,  # type: ignore[no-untyped-def]
    source_file=None,
    task="t",
    store="sqlite:///test",
) -> Outcome:
    return worker._call(
        kind,
        config,
        auth,
        context or {},
        execution_id,
        secrets if secrets is not None else set(),
        task=task,
        source_file=source_file,
        store=store,
    )


@pytest.fixture
def pg_credential(monkeypatch: pytest.MonkeyPatch, pg_dsn: str) -> str:
    monkeypatch.setenv("NOETL_AUTH_CONF_PG", pg_dsn)
    return "conf_pg"


def table_name() -> str:
    return f"conf_{uuid.uuid4().hex[:10]}"


# ------------------------------------------------------------------ postgres


def test_postgres_credential_is_an_alias_of_auth(pg_credential: str) -> None:
    plan = compile_text(one_step(f"kind: postgres\ncredential: {pg_credential}\ncommand: SELECT 41 + 1 AS n\n"))
    task = plan.steps["start"].tasks[0]
    assert task.auth is None and task.config["credential"] == pg_credential
    outcome = call("postgres", task.config, auth=task.auth)
    assert outcome.status == "ok", outcome.error
    assert outcome.data["rows"] == [{"n": 42}]


def test_postgres_one_statement_is_stored_flat_and_also_reads_as_command_0(pg_credential: str) -> None:
    outcome = call("postgres", {"command": "SELECT 1 AS a UNION ALL SELECT 2 ORDER BY 1"}, auth=pg_credential)
    statement = {"rows": [{"a": 1}, {"a": 2}], "row_count": 2, "columns": ["a"], "statusmessage": "SELECT 2"}
    # stored once, flat, as NoETL's latest server gives it
    assert outcome.data == {"status": "success", **statement, "statement_count": 1}
    # the view templates read also answers NoETL's numbered form, sharing the same rows
    view = both_forms(outcome.data)
    assert view["command_0"] == statement and view["command_0"]["rows"] is outcome.data["rows"]


def test_postgres_pool_is_accepted_as_advisory_and_checked(pg_credential: str) -> None:
    step = f"kind: postgres\nauth: {pg_credential}\npool: {{max_size: 4}}\ncommand: SELECT 1 AS x\n"
    plan = compile_text(one_step(step))
    task = plan.steps["start"].tasks[0]
    assert call("postgres", task.config, auth=task.auth).data["rows"] == [{"x": 1}]
    assert compile_text(one_step("kind: postgres\npool: {}\ncommand: SELECT 1\n")).steps["start"].tasks[0]
    found = problems(one_step("kind: postgres\npool: big\ncommand: SELECT 1\n"))
    assert [(p.path, p.message) for p in found] == [
        ("workflow[0](start).tool.pool", "must be a mapping or true or false, not a string")
    ]


def test_postgres_script_from_a_file_relative_to_the_playbook(tmp_path: Path, pg_credential: str, pg_dsn: str) -> None:
    table = table_name()
    (tmp_path / "sql").mkdir()
    (tmp_path / "sql" / "create.sql").write_text(
        f"CREATE TABLE public.{table} (id int primary key, name text);\n"
        f"INSERT INTO public.{table} VALUES (1, 'a'), (2, 'b');\n"
        f"SELECT count(*) AS n FROM public.{table};\n"
    )
    playbook = tmp_path / "pb.yaml"
    playbook.write_text(
        V2
        + one_step(f"kind: postgres\nauth: {pg_credential}\nscript: {{uri: sql/create.sql, source: {{type: file}}}}\n")
    )
    task = load_plan(playbook).steps["start"].tasks[0]
    outcome = call("postgres", task.config, auth=task.auth, source_file=str(playbook))
    assert outcome.status == "ok", outcome.error
    assert outcome.data["statement_count"] == 3 and "rows" not in outcome.data  # numbered, rows stored once
    assert outcome.data["command_2"]["rows"] == [{"n": 2}] and both_forms(outcome.data)["rows"] == [{"n": 2}]
    with psycopg2.connect(pg_dsn) as conn, conn.cursor() as cur:
        cur.execute(f"SELECT name FROM public.{table} ORDER BY id")
        assert cur.fetchall() == [("a",), ("b",)]
        cur.execute(f"DROP TABLE public.{table}")


def test_postgres_script_inline_and_over_http(pg_credential: str, script_server: str) -> None:
    inline = {"script": {"uri": "inline", "source": {"type": "inline", "code": "SELECT 6 * 7 AS n"}}}
    outcome = call("postgres", inline, auth=pg_credential)
    assert outcome.status == "ok", outcome.error
    assert outcome.data["rows"] == [{"n": 42}]
    fetched = {"script": {"uri": f"{script_server}/create.sql", "source": {"type": "http"}}}
    outcome = call("postgres", fetched, auth=pg_credential)
    assert outcome.status == "ok", outcome.error
    assert outcome.data["rows"] == [{"source": "http"}]
    missing = call("postgres", {"script": {"uri": f"{script_server}/nope.sql", "source": {"type": "http"}}})
    assert missing.status == "error" and missing.error["message"].endswith("cannot be fetched: HTTP 404")


# ------------------------------------------------------------------ duckdb


def test_duckdb_query_with_list_and_named_params() -> None:
    cfg = {"database": ":memory:", "query": "SELECT * FROM range(5) t(i) WHERE i >= ? ORDER BY i", "params": [3]}
    outcome = call("duckdb", cfg)
    assert outcome.status == "ok", outcome.error
    assert outcome.data["rows"] == [{"i": 3}, {"i": 4}] and outcome.data["columns"] == ["i"]
    assert "command_0" not in outcome.data and both_forms(outcome.data)["command_0"]["rows"] == outcome.data["rows"]
    named = call("duckdb", {"database": ":memory:", "command": "SELECT $a + $b AS s", "params": {"a": 1, "b": 2}})
    assert named.data["rows"] == [{"s": 3}]


def test_duckdb_sql_errors_are_reported() -> None:
    outcome = call("duckdb", {"database": ":memory:", "query": "SELECT * FROM no_such_table"})
    assert outcome.status == "error" and outcome.error is not None
    assert outcome.error["kind"] == "sql_error" and "no_such_table" in outcome.error["message"]


def test_duckdb_each_execution_has_its_own_database_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("NOETL_DUCKDB_DIR", str(tmp_path))
    create = {"query": "CREATE TABLE t AS SELECT 7 AS v"}
    assert call("duckdb", create, execution_id=1).status == "ok"
    again = call("duckdb", {"query": "SELECT v FROM t"}, execution_id=1)
    assert again.data["rows"] == [{"v": 7}]  # a later step of the same execution sees the table
    other = call("duckdb", {"query": "SELECT v FROM t"}, execution_id=2)
    assert other.status == "error" and "t" in other.error["message"]  # type: ignore[index]
    other_store = call("duckdb", {"query": "SELECT v FROM t"}, execution_id=1, store="postgresql://elsewhere/db")
    assert other_store.status == "error"  # the same id in another event store is another execution
    assert Path(again.data["database"]).parent.parent == tmp_path
    assert Path(again.data["database"]).name == "execution_1.duckdb"


def test_duckdb_database_named_by_the_playbook(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("NOETL_DUCKDB_DIR", str(tmp_path / "dir"))
    relative = call("duckdb", {"database": "shared/analytics.duckdb", "query": "CREATE TABLE s AS SELECT 1 AS x"})
    assert relative.data["database"] == str(tmp_path / "dir" / "shared" / "analytics.duckdb")
    absolute = tmp_path / "abs.duckdb"
    call("duckdb", {"database": str(absolute), "query": "CREATE TABLE a AS SELECT 2 AS y"}, execution_id=9)
    assert call("duckdb", {"database": str(absolute), "query": "SELECT y FROM a"}, execution_id=10).data["rows"] == [
        {"y": 2}
    ]


def test_duckdb_attaches_postgres_through_a_credential(pg_dsn: str, monkeypatch: pytest.MonkeyPatch) -> None:
    table = table_name()
    with psycopg2.connect(pg_dsn) as conn, conn.cursor() as cur:
        cur.execute(f"CREATE TABLE public.{table} (id int, name text); INSERT INTO public.{table} VALUES (1, 'pg')")
    # trust authentication ignores the password, so it can stand for a real one in this test
    monkeypatch.setenv("NOETL_AUTH_CONF_PG_PW", json.dumps({"dsn": f"{pg_dsn} password=hunter-secret-77"}))
    secrets: set[str] = set()
    cfg = {
        "database": ":memory:",
        "attach": {"pg": "conf_pg_pw"},
        "query": f"INSERT INTO pg.public.{table} VALUES (2, 'duck'); "
        f"SELECT id, name FROM pg.public.{table} ORDER BY id",
    }
    outcome = call("duckdb", cfg, secrets=secrets)
    assert outcome.status == "ok", outcome.error
    assert outcome.data["rows"] == [{"id": 1, "name": "pg"}, {"id": 2, "name": "duck"}]
    assert "hunter-secret-77" in secrets  # handed to the worker's masking
    with psycopg2.connect(pg_dsn) as conn, conn.cursor() as cur:
        cur.execute(f"SELECT name FROM public.{table} WHERE id = 2")
        assert cur.fetchall() == [("duck",)]
        cur.execute(f"DROP TABLE public.{table}")


def test_duckdb_attach_names_a_missing_credential() -> None:
    outcome = call("duckdb", {"database": ":memory:", "attach": {"pg": "no_such_cred"}, "query": "SELECT 1"})
    assert outcome.status == "error" and outcome.error is not None
    assert outcome.error["message"].startswith("duckdb: attach pg: credential 'no_such_cred' not found")


def test_duckdb_settings_are_checked_at_validate() -> None:
    found = problems(one_step("kind: duckdb\nquery: SELECT 1\nattach: [pg_local]\nparams: 5\n"))
    assert [(p.path, p.message) for p in found] == [
        ("workflow[0](start).tool.attach", "must be a mapping, not a list"),
        ("workflow[0](start).tool.params", "must be a list or a mapping, not a number"),
    ]


# ------------------------------------------------------------------ secrets


def test_secrets_tool_reads_the_credential_sources_and_hands_the_value_to_masking(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("NOETL_AUTH_TEST_SECRET", "s3cr3t-from-env")
    secrets: set[str] = set()
    outcome = call("secrets", {"provider": "env"}, task="TEST_SECRET", secrets=secrets)
    assert outcome.data == {"name": "TEST_SECRET", "provider": "env", "value": "s3cr3t-from-env"}
    assert "s3cr3t-from-env" in secrets and "secret_values" not in outcome.meta
    assert credentials.scrub(outcome.to_dict(), secrets)["data"]["value"] == "***"

    store = tmp_path / "creds.yaml"
    store.write_text("api:\n  token: tok-from-file-123\n  host: example\n")
    monkeypatch.setenv("NOETL_CREDENTIALS_FILE", str(store))
    from_file: set[str] = set()
    keyed = call("secrets", {"key": "api"}, secrets=from_file)
    assert keyed.data["value"] == {"token": "tok-from-file-123", "host": "example"}
    assert from_file == {"tok-from-file-123"}


def test_secrets_tool_names_a_missing_secret_and_refuses_cloud_providers() -> None:
    outcome = call("secrets", {}, task="NOT_THERE_AT_ALL")
    assert outcome.error is not None and outcome.error["message"].startswith(
        "secrets: credential 'NOT_THERE_AT_ALL' not found"
    )
    found = problems(one_step("kind: secrets\nkey: x\nprovider: aws\n"))
    assert len(found) == 1 and found[0].path == "workflow[0](start).tool.provider"
    assert found[0].message.startswith(
        "secrets provider 'aws' cannot run here: a cloud secret manager needs a cloud identity"
    )


def test_postgres_credential_in_the_legacy_dialect_and_given_twice(pg_credential: str) -> None:
    legacy = "apiVersion: noetl.io/v1\nkind: Playbook\nmetadata:\n  name: t\n"
    body = (
        f"workflow:\n  - step: start\n    tool: postgres\n    credential: {pg_credential}\n"
        "    command: SELECT 5 AS five\n"
    )
    task = load_plan("pb.yaml", text=legacy + body).steps["start"].tasks[0]
    assert call("postgres", task.config, auth=task.auth).data["rows"] == [{"five": 5}]
    found = problems(one_step(f"kind: postgres\nauth: {pg_credential}\ncredential: other\ncommand: SELECT 1\n"))
    assert [str(p) for p in found] == [
        "pb.yaml:10: workflow[0](start).tool.credential: give the credential once: auth or credential"
    ]


def test_duckdb_auth_aliases_become_duckdb_secrets_as_in_noetl(pg_dsn: str, pg_credential: str) -> None:
    table = table_name()
    with psycopg2.connect(pg_dsn) as conn, conn.cursor() as cur:
        cur.execute(f"CREATE TABLE public.{table} (id int); INSERT INTO public.{table} VALUES (1), (2), (3)")
    step = (
        "kind: duckdb\ndatabase: ':memory:'\n"
        f"auth:\n  pg_db: {{source: credential, type: postgres, key: {pg_credential}}}\n"
        "commands: |\n  INSTALL postgres;\n  LOAD postgres;\n"
        "  ATTACH '' AS pg_db (TYPE postgres, SECRET pg_db);\n"
        f"  SELECT count(*) AS n FROM pg_db.public.{table};\n"
    )
    task = compile_text(one_step(step)).steps["start"].tasks[0]
    assert task.auth == {"pg_db": {"source": "credential", "type": "postgres", "key": pg_credential}}
    outcome = call("duckdb", task.config, auth=task.auth)
    assert outcome.status == "ok", outcome.error
    assert outcome.data["rows"] == [{"n": 3}]
    single = call(
        "duckdb",
        {
            "database": ":memory:",
            "query": f"ATTACH '' AS db (TYPE postgres); SELECT max(id) AS m FROM db.public.{table}",
        },
        auth=pg_credential,
    )
    assert single.status == "ok", single.error
    assert single.data["rows"] == [{"m": 3}]
    with psycopg2.connect(pg_dsn) as conn, conn.cursor() as cur:
        cur.execute(f"DROP TABLE public.{table}")
