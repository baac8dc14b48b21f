"""The ducklake tool: a DuckLake catalog in PostgreSQL (the credential by name) or SQLite, data
files in a folder every worker reaches; two writes, then a time-travel read of the first snapshot.
On the harness, embedded and through real workers on Redis + PostgreSQL."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from noetl_celery.core.errors import PlaybookError
from noetl_celery.dsl import load_plan
from tests.support.harness import run_playbook

PLAYBOOK = Path(__file__).resolve().parents[2] / "playbooks" / "ducklake_time_travel.yaml"


def _parquet_files(folder: Path) -> list[Path]:
    return sorted(folder.rglob("*.parquet"))


@pytest.mark.smoke
def test_a_postgres_catalog_writes_twice_and_reads_the_first_snapshot(engine, tmp_path_factory, pg_dsn):
    data = tmp_path_factory.getbasetemp() / "lake-data"  # the catalog (the session's database) keeps its path
    run = engine.run(PLAYBOOK, {"data_path": str(data)})
    assert run.returncode == 0, (run.status.get("error"), run.stderr)
    assert run.results["end"] == {"before": {"n": 2, "total": 30}, "now": {"n": 3, "total": 60}}
    create, add = run.results["create"], run.results["add"]
    assert create["command_count"] == 2 and create["commands"][1]["affected_rows"] == 2
    assert add["commands"][0] == {"command_index": 0, "affected_rows": 1, "status": "executed"}
    assert add["catalog"]["snapshot_id"] > create["catalog"]["snapshot_id"]
    # one data file per write, in the folder every worker reaches
    assert len(_parquet_files(data / "main" / f"orders_{run.execution_id}")) == 2
    # the catalog's connection (its DSN is the credential's value) is nowhere in the event log
    assert pg_dsn not in json.dumps(engine.events(run.execution_id), default=str)


def test_a_sqlite_catalog_on_the_harness(tmp_path, sqlite_url):
    sets = {"data_path": str(tmp_path / "data"), "catalog": f"sqlite:{tmp_path / 'catalog.sqlite'}"}
    returncode, status = run_playbook(sqlite_url, PLAYBOOK, sets, {})
    assert returncode == 0, status.get("error")
    assert status["results"]["end"] == {"before": {"n": 2, "total": 30}, "now": {"n": 3, "total": 60}}
    assert (tmp_path / "catalog.sqlite").is_file()


def test_a_failing_command_fails_the_attempt_naming_the_command(tmp_path, sqlite_url):
    text = PLAYBOOK.read_text().replace(
        "INSERT INTO orders_{{ execution_id }} VALUES (3, 'Carol', 30)", "INSERT INTO no_such_table VALUES (1)"
    )
    broken = tmp_path / "broken.yaml"
    broken.write_text(text)
    sets = {"data_path": str(tmp_path / "data"), "catalog": f"sqlite:{tmp_path / 'catalog.sqlite'}"}
    returncode, status = run_playbook(sqlite_url, broken, sets, {})
    assert returncode == 1
    assert status["error"]["kind"] == "sql_error"
    assert "command 1 of 1" in status["error"]["message"] and "no_such_table" in status["error"]["message"]


def test_validate_names_a_missing_catalog_name():
    text = PLAYBOOK.read_text().replace("    catalog_name: lake\n", "", 1)
    with pytest.raises(PlaybookError) as raised:
        load_plan("ducklake.yaml", text=text)
    assert "ducklake tool needs one of: catalog_name" in str(raised.value)
