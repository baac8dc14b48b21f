"""NoETL playbooks that use the duckdb, secrets, python libs:/script: and postgres script:/
credential:/pool: forms, run unmodified on both deployments (corpus files, plus two small
playbooks of our own for what the corpus does not show)."""

from __future__ import annotations

import json
from pathlib import Path

import psycopg2
import pytest
import yaml

from tests.e2e.conftest import TEST_SECRET
from tests.e2e.test_core import corpus

PLAYBOOKS = Path(__file__).resolve().parents[1] / "playbooks"
ALICE_AND_CHARLIE = [{"name": "Alice", "age": 30}, {"name": "Charlie", "age": 35}]


def event_text(engine, execution_id: int) -> str:
    return json.dumps(engine.events(execution_id), default=str)


@pytest.mark.smoke
def test_duckdb_corpus_playbook(engine):
    run = engine.run(corpus("renames-2026-04/duckdb_test.yaml"))
    assert run.returncode == 0, (run.status.get("error"), run.stderr)
    start = run.results["start"]
    # stored once, flat (templates also read it as `command_0`)
    assert start["rows"] == ALICE_AND_CHARLIE and "command_0" not in start and start["statement_count"] == 1
    assert start["database"] == ":memory:"
    # `{{ start }}` reads as the list of rows, as the playbook's own check expects.
    assert run.results["process"]["users"] == ALICE_AND_CHARLIE
    assert run.results["verify"] == {"verified": True, "avg_age": 32.5, "status": "passed"}
    assert run.results["end"] == {"status": "completed", "test_passed": True}


def test_python_libs_corpus_playbook(engine):
    run = engine.run(corpus("renames-2026-04/vars_simple_libs.yaml"))
    assert run.returncode == 0, (run.status.get("error"), run.stderr)
    assert run.results["get_var"] == {
        "status": "success",
        "value": 42,
        "message": "Variable set successfully",
        "verification": True,
    }


def test_python_inline_script_corpus_playbook(engine):
    run = engine.run(corpus("renames-2026-04/script_python_loading.yaml"))
    assert run.returncode == 0, (run.status.get("error"), run.stderr)
    assert run.results["start"] == {"message": "Script loading works!", "status": "success"}
    # `end` reads the step that routed to it as `{{ result }}` and asserts its status.
    assert run.results["end"] == {"test": "passed"}


def test_a_tool_reads_the_step_that_routed_to_it_as_result(engine):
    run = engine.run(PLAYBOOKS / "result_of_previous_step.yaml")
    assert run.returncode == 0, (run.status.get("error"), run.stderr)
    assert run.results["a"] == {"from": "a", "got": {"from": "start"}}
    assert run.results["after_a"] == {"got": "a"}  # each run reads its own predecessor
    assert run.results["b"] == {"got": "start"}


def test_a_workload_value_named_result_wins_over_the_previous_step(engine):
    run = engine.run(PLAYBOOKS / "result_of_previous_step.yaml", {"result": {"from": "workload"}})
    assert run.returncode == 0, (run.status.get("error"), run.stderr)
    assert run.results["a"]["got"] == {"from": "workload"}
    assert run.results["b"] == {"got": "workload"}


def test_postgres_file_script_corpus_playbook(engine, tmp_path, pg_dsn):
    script = tmp_path / "create_test_table.sql"
    script.write_text(
        "DROP TABLE IF EXISTS public.script_test;\n"
        "CREATE TABLE public.script_test (id int PRIMARY KEY, name text);\n"
        "INSERT INTO public.script_test VALUES (1, 'first'), (2, 'second');\n"
    )
    run = engine.run(corpus("renames-2026-04/script_postgres_file.yaml"), {"script_path": str(script)})
    assert run.returncode == 0, (run.status.get("error"), run.stderr)
    assert run.results["verify_records"]["rows"] == [{"id": 1, "name": "first"}, {"id": 2, "name": "second"}]
    with psycopg2.connect(pg_dsn) as conn, conn.cursor() as cur:
        cur.execute("SELECT to_regclass('public.script_test')")
        assert cur.fetchone() == (None,)  # the playbook's cleanup step ran


def test_actions_corpus_playbook_reaches_its_own_success(engine):
    run = engine.run(corpus("renames-2026-04/actions_secrets.yaml"))
    assert run.returncode == 0, (run.status.get("error"), run.stderr)
    # `aggregate` reads the loop's results as `ctx.loop_results` (entered from the loop step's arc).
    assert run.results["aggregate"] == {"count": 3, "original_sum": 60, "doubled_sum": 120}
    assert run.results["verify"]["success"] is True and run.results["end"] == {"status": "completed", "success": True}
    # the exclusive arc takes `helper`; `test_secrets` is the other branch and does not run
    assert run.results["helper"]["helper_called"] is True and "test_secrets" not in run.results


@pytest.mark.smoke
def test_secrets_corpus_step_masks_the_value(engine, tmp_path):
    # The corpus file's secrets step, on its own (in the file it is the branch not taken).
    source = corpus("renames-2026-04/actions_secrets.yaml").read_text()
    doc = yaml.safe_load(source)
    doc["workflow"] = [s for s in doc["workflow"] if s["step"] == "test_secrets"]
    doc["workflow"][0]["step"] = "start"
    doc["workflow"][0].pop("next")
    playbook = tmp_path / "secrets_step.yaml"
    playbook.write_text(yaml.safe_dump(doc))
    run = engine.run(playbook)
    assert run.returncode == 0, (run.status.get("error"), run.stderr)
    assert run.results["start"] == {"name": "TEST_SECRET", "provider": "env", "value": "***"}
    assert TEST_SECRET not in event_text(engine, run.execution_id)
    assert TEST_SECRET not in json.dumps(run.status) and TEST_SECRET not in run.stderr


def test_a_secret_is_masked_in_every_row_also_where_a_later_step_uses_it(engine):
    run = engine.run(PLAYBOOKS / "secrets_masked.yaml")
    assert run.returncode == 0, (run.status.get("error"), run.stderr)
    assert run.results["use"] == {"seen": "***"}
    text = event_text(engine, run.execution_id)
    assert TEST_SECRET not in text and "TEST_SECRET" in text  # the name is there, never the value


@pytest.mark.smoke
def test_postgres_dollar_params_and_both_result_forms(engine, pg_dsn):
    run = engine.run(PLAYBOOKS / "postgres_dollar_params.yaml")
    assert run.returncode == 0, (run.status.get("error"), run.stderr)
    assert run.results["read"] == {
        "labels": ["item-3", "item-4", "item-5"],
        "ns": [3, 4, 5],
        "literal": "$3",
        "duck_flat": {"doubled": 6, "word": "item-3"},
        "duck_numbered": 6,
    }
    start = run.results["start"]
    assert start["statement_count"] == 1 and start["row_count"] == 3 and "command_0" not in start


def test_postgres_credential_pool_and_noetl_result_shape(engine):
    run = engine.run(PLAYBOOKS / "postgres_noetl_shape.yaml")
    assert run.returncode == 0, (run.status.get("error"), run.stderr)
    assert run.results["read"] == {"rows": 42, "command_0": 42, "nested": 42}
