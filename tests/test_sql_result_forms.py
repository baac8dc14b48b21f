"""postgres `$N` parameters and the one result shape of both NoETL eras, on the in-process
harness with a real PostgreSQL (and DuckDB): `params` bound to `$1..$N` beside `%s`/`%(name)s`,
`$N` inside literals, dollar quotes and comments left alone, the placeholder count checked at
validate, and a SQL result stored once that reads as `rows` and as `command_0`."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path
from typing import Any

import pytest

from noetl_celery.config import limits
from noetl_celery.tools.base import ToolCall, run_tool
from noetl_celery.tools.sql_text import placeholders
from tests.support.harness import run_playbook
from tests.test_tool_settings import V2, compile_text, one_step, problems

pytestmark = pytest.mark.services


@pytest.fixture
def pg_local(fresh_postgres) -> dict[str, str]:
    """`auth: pg_local` naming a database of this test's own."""
    return {"NOETL_AUTH_PG_LOCAL": fresh_postgres.dsn}


def _run(url: str, tmp_path: Path, text: str, env: dict[str, str]) -> tuple[int, dict[str, Any]]:
    path = tmp_path / "pb.yaml"
    path.write_text(textwrap.dedent(text))
    return run_playbook(url, path, env=env)


def _ok(url: str, tmp_path: Path, text: str, env: dict[str, str]) -> dict[str, Any]:
    code, status = _run(url, tmp_path, text, env)
    assert (code, status["status"]) == (0, "completed"), status["error"]
    return status


def _pg(dsn: str, **config: Any) -> Any:
    return run_tool(ToolCall(kind="postgres", config=config, credential=dsn))


# --- finding the placeholders ----------------------------------------------------------------


def test_a_placeholder_is_a_dollar_number_outside_literals_quotes_and_comments() -> None:
    text = (
        "SELECT $1, '$2', E'\\' $3', \"col$4\", a$5, $$ $6 $$, $tag$ $7 $tag$ -- $8\n"
        "/* $9 /* nested $10 */ */ FROM t WHERE b = $11::int AND c = $2"
    )
    assert [n for n, _, _ in placeholders(text)] == [1, 11, 2]


# --- binding, against a real PostgreSQL ----------------------------------------------------------


def test_a_list_binds_dollar_n_as_noetls_rust_tool_does(fresh_postgres) -> None:
    out = _pg(
        fresh_postgres.dsn,
        command="SELECT $1::int + 1 AS n, $2 AS s, $3::jsonb AS j, $4::boolean AS b, $5::text IS NULL AS z, 5-$6 AS d",
        params=[41, "O'Brien; --", {"a": [1, 2]}, True, None, -3],
    )
    assert out.status == "ok", out.error
    assert out.data["rows"] == [{"n": 42, "s": "O'Brien; --", "j": {"a": [1, 2]}, "b": True, "z": True, "d": 8}]


def test_a_mapping_binds_its_values_in_order_or_by_number(fresh_postgres) -> None:
    in_order = _pg(fresh_postgres.dsn, command="SELECT $1 AS a, $2::int AS b", params={"name": "x", "count": 2})
    assert in_order.data["rows"] == [{"a": "x", "b": 2}], in_order.error
    numbered = _pg(fresh_postgres.dsn, command="SELECT $1 AS a, $2::int AS b", params={"$2": 7, "1": "y"})
    assert numbered.data["rows"] == [{"a": "y", "b": 7}], numbered.error


def test_dollar_n_in_literals_bodies_and_comments_is_left_as_written(fresh_postgres) -> None:
    text = (
        "CREATE FUNCTION add_one(int) RETURNS int LANGUAGE sql AS $body$ SELECT $1 + 1 $body$;\n"
        "-- the call below binds $1 only\n"
        "SELECT add_one($1) AS n, '$2 stays' AS s, 'it''s 100%' AS p"
    )
    out = _pg(fresh_postgres.dsn, command=text, params=[9])
    assert out.status == "ok", out.error
    assert out.data["command_1"]["rows"] == [{"n": 10, "s": "$2 stays", "p": "it's 100%"}]


def test_the_older_forms_keep_binding(fresh_postgres) -> None:
    named = _pg(fresh_postgres.dsn, command="SELECT %(a)s::int AS a, '50%%' AS p", params={"a": 1})
    assert named.data["rows"] == [{"a": 1, "p": "50%"}], named.error
    listed = _pg(fresh_postgres.dsn, command="SELECT %s::int AS a", params=[2])
    assert listed.data["rows"] == [{"a": 2}], listed.error


def test_a_count_that_does_not_match_fails_the_call_before_the_server_sees_it(fresh_postgres) -> None:
    out = _pg(fresh_postgres.dsn, command="CREATE TABLE never (x int); SELECT $1, $3", params=[1, 2])
    assert out.status == "error" and out.error["kind"] == "invalid_args"
    assert out.error["message"] == "postgres: the SQL's placeholders go up to $3 but params gives 2 values"
    gap = _pg(fresh_postgres.dsn, command="SELECT $1, $2, $3", params={"1": "a", "$3": "c"})
    assert gap.status == "error" and gap.error["kind"] == "invalid_args"
    assert (
        gap.error["message"] == "postgres: params gives no value for $2 (its keys are numbers: each $N needs its own)"
    )
    check = _pg(fresh_postgres.dsn, command="SELECT to_regclass('never') IS NULL AS gone")
    assert check.data["rows"] == [{"gone": True}]


# --- validate ----------------------------------------------------------------------------------


def test_validate_names_the_params_line_when_the_count_does_not_match() -> None:
    body = one_step("kind: postgres\ncommand: SELECT $1, $2\nparams: [1]\n")
    line = (V2 + body).splitlines().index("      params: [1]") + 1
    assert [(p.path, p.line, p.message) for p in problems(body)] == [
        ("workflow[0](start).tool.params", line, "the SQL's placeholders go up to $2 but params gives 1 value")
    ]
    found = problems(one_step("kind: postgres\nquery: \"SELECT $1, '$2', $3\"\nparams: {a: 1, b: 2}\n"))
    assert [p.message for p in found] == ["the SQL's placeholders go up to $3 but params gives 2 values"]


def test_validate_leaves_a_template_text_or_params_to_the_run() -> None:
    compile_text(one_step('kind: postgres\ncommand: "SELECT $1, {{ workload.x }}"\nparams: [1]\n'))
    compile_text(one_step('kind: postgres\ncommand: SELECT $1, $2\nparams: "{{ workload.p }}"\n'))
    # the number of values is literal even when the values are templates; `%s` forms are not counted
    compile_text(one_step('kind: postgres\ncommand: SELECT $1, $2\nparams: ["{{ workload.a }}", 2]\n'))
    compile_text(one_step("kind: postgres\ncommand: SELECT %s, '$7'\nparams: [1]\n"))


# --- one result shape for both eras, through the engine -----------------------------------------


BOTH_ERAS = """
apiVersion: noetl.io/v2
kind: Playbook
metadata: {name: both_eras}
workload: {min_id: 2}
workflow:
  - step: start
    tool:
      kind: postgres
      auth: pg_local
      command: "SELECT g AS id, 'row-' || g AS label FROM generate_series($1::int, $2::int) AS g ORDER BY g"
      params: ["{{ workload.min_id }}", 4]
    next: {arcs: [{step: multi}]}
  - step: multi
    tool:
      kind: postgres
      auth: pg_local
      command: "CREATE TABLE seen AS SELECT $1::int AS n; SELECT n + 1 AS next FROM seen"
      params: {n: 7}
    next: {arcs: [{step: picked}]}
  - step: picked
    tool: {kind: postgres, auth: pg_local, command: "SELECT 1 AS one"}
    result: {output_select: command_0.rows}
    next: {arcs: [{step: read}]}
  - step: read
    tool:
      kind: python
      input:
        flat: "{{ start.rows | map(attribute='id') | list }}"
        numbered: "{{ start.command_0.rows | map(attribute='label') | list }}"
        legacy: "{{ start.data.result.command_0.row_count }}"
        multi_flat: "{{ multi.rows[0].next }}"
        multi_numbered: "{{ multi.command_1.rows[0].next }}"
        whole: "{{ start }}"
      code: |
        result = {"flat": flat, "numbered": numbered, "legacy": legacy, "multi_flat": multi_flat,
                  "multi_numbered": multi_numbered, "whole_keys": sorted(whole)}
"""


def test_a_playbook_of_either_era_reads_the_result_it_expects(sqlite_url, tmp_path, pg_local) -> None:
    status = _ok(sqlite_url, tmp_path, BOTH_ERAS, pg_local)
    assert status["results"]["read"] == {
        "flat": [2, 3, 4],
        "numbered": ["row-2", "row-3", "row-4"],
        "legacy": 3,
        "multi_flat": 8,
        "multi_numbered": 8,
        # a whole result handed on as data carries both forms
        "whole_keys": ["columns", "command_0", "row_count", "rows", "statement_count", "status", "statusmessage"],
    }
    start = status["results"]["start"]
    # stored once: flat, no `command_0` beside it, each row's text once in the stored JSON
    assert start == {
        "status": "success",
        "rows": [{"id": 2, "label": "row-2"}, {"id": 3, "label": "row-3"}, {"id": 4, "label": "row-4"}],
        "row_count": 3,
        "columns": ["id", "label"],
        "statusmessage": "SELECT 3",
        "statement_count": 1,
    }
    assert json.dumps(start).count("row-3") == 1
    # a dotted output_select names NoETL's numbered form of a flat result too
    assert status["results"]["picked"] == [{"one": 1}]
    multi = status["results"]["multi"]
    assert set(multi) == {"status", "statement_count", "command_0", "command_1"}
    assert multi["command_0"]["affected_rows"] == 1 and multi["command_1"]["rows"] == [{"next": 8}]


BIG = """
apiVersion: noetl.io/v2
kind: Playbook
metadata: {name: big_sql}
workflow:
  - step: start
    tool:
      kind: postgres
      auth: pg_local
      command: "SELECT g AS id, repeat('x', 200) AS pad FROM generate_series(1, $1::int) AS g"
      params: [100]
    next: {arcs: [{step: read}]}
  - step: read
    tool:
      kind: python
      input: {numbered: "{{ start.command_0.rows | length }}", flat: "{{ start.rows[99].id }}"}
      code: "result = {'numbered': numbered, 'flat': flat}"
"""
BIG_INPUT = 'input: {numbered: "{{ start.command_0.rows | length }}", flat: "{{ start.rows[99].id }}"}'


def test_a_result_above_the_row_cap_goes_by_reference_and_reads_in_both_forms(sqlite_url, tmp_path, pg_local):
    env = {**pg_local, "NOETL_MAX_RESULT_BYTES": "4000"}  # 100 rows of ~220 bytes are above it
    status = _ok(sqlite_url, tmp_path, BIG, env)
    assert status["results"]["read"] == {"numbered": 100, "flat": 100}
    from noetl_celery import runner

    rows = [r for r in runner.execution_events(sqlite_url, status["execution_id"]) if r.get("step") == "start"]
    stored = [r for r in rows if limits.STORED in json.dumps(r.get("result"), default=str)]
    assert stored, "the start step's result was not stored by reference"
    assert all("x" * 200 not in json.dumps(r, default=str) for r in rows)  # no row holds the rows


def test_a_cut_result_is_never_read_as_the_real_one_in_either_form(sqlite_url, tmp_path, pg_local):
    env = {**pg_local, "NOETL_MAX_RESULT_BYTES": "4000", "NOETL_MAX_STORED_BYTES": "8000"}
    for read in ("{{ start.command_0.rows | length }}", "{{ start.rows | length }}"):
        text = BIG.replace(BIG_INPUT, f'input: {{numbered: "{read}", flat: 0}}')
        assert text != BIG
        _, status = _run(sqlite_url, tmp_path, text, env)
        assert status["status"] == "failed" and status["failed_step"] == "read", status
        assert limits.is_truncated(status["results"]["start"])
        assert "truncated when stored" in status["error"]["message"], status["error"]
