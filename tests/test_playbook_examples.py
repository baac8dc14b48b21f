"""The runnable examples in playbooks/: every one validates, and every one that needs no server
runs to completion with `noetl-celery run --json` in a fresh NOETL_HOME, the way the README says.
The two that need a server run against a real one (the bundled mock API, a fresh PostgreSQL)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.support.engines import REPO_ROOT, cli
from tests.support.mockapi import start_mock_api

PLAYBOOKS = REPO_ROOT / "playbooks"
ALL = sorted(path.name for path in PLAYBOOKS.glob("*.yaml"))
NEEDS_A_SERVER = {
    "http_mock.yaml": "the mock API",
    "postgres_example.yaml": "PostgreSQL (pg_local)",
    "cursor_redis_stream.yaml": "Redis",
    "ducklake_time_travel.yaml": "PostgreSQL (pg_local; or --set catalog=sqlite:FILE)",
}
STANDALONE = [name for name in ALL if name not in NEEDS_A_SERVER]
RUN_TIMEOUT = 120  # seconds

# What each standalone example must produce: step -> its result.
EXPECTED = {
    "hello_world.yaml": {"end": {"greeting": "HELLO WORLD FROM NOETL_CELERY", "branch": "long"}},
    "branching.yaml": {"done": {"route": "manual", "customs": "not needed"}},
    "fan_out_join.yaml": {"merge": {"sum": 31, "range": [1, 9], "evens": [4, 2, 6]}},
    "cursor_queue.yaml": {
        "drain": {"stats": {"processed": 40, "failed": 0, "slots": 4}},
        "report": {
            "done": 40,
            "sum_of_squares": sum(n * n for n in range(1, 41)),
            "stats": {"processed": 40, "failed": 0, "slots": 4},
        },
    },
    "loop_batched.yaml": {
        "summary": {
            "count": 2000,
            "sum": sum(i * i for i in range(2000)),
            "in_order": True,
            "stats": {"total": 2000, "success": 2000, "failed": 0},
        }
    },
    "transfer_files.yaml": {
        "report": {"exported": 1000, "loaded": 1000, "load_chunks": 4, "identical_rows": 1000, "rows_in_copy": 1000}
    },
    "loop_parallel.yaml": {
        "summary": {
            "order": ["Oslo", "Lisbon", "Cairo", "Reykjavik", "Singapore", "Montreal"],
            "hot": ["Cairo", "Singapore"],
            "stats": {"total": 6, "success": 6, "failed": 0},
        }
    },
}


def run(playbook: Path, tmp_path: Path, *sets: str, env: dict[str, str] | None = None) -> dict:
    """Run an example; returns its final status as `noetl-celery status --json` reads it back."""
    home_env = {"NOETL_HOME": str(tmp_path / "home"), **(env or {})}
    args = ["run", "--json", "--timeout", str(RUN_TIMEOUT), str(playbook)]
    for item in sets:
        args += ["--set", item]
    proc = cli(args, home_env, timeout=RUN_TIMEOUT + 60)
    assert proc.returncode == 0, (proc.stdout, proc.stderr[-3000:])
    listing = cli(["executions", "--limit", "1"], home_env)
    assert listing.returncode == 0, listing.stderr
    execution_id = listing.stdout.split()[0]
    status = cli(["status", "--json", execution_id], home_env)
    assert status.returncode == 0, status.stdout + status.stderr
    outcome = json.loads(status.stdout)
    assert outcome["status"] == "completed" and outcome["error"] is None, outcome
    return outcome


def test_the_examples_are_all_accounted_for():
    assert {
        "hello_world.yaml",
        "branching.yaml",
        "fan_out_join.yaml",
        "loop_parallel.yaml",
        "http_mock.yaml",
        "postgres_example.yaml",
    } <= set(ALL)
    assert set(STANDALONE) <= set(EXPECTED), "give every standalone example its expected results"


@pytest.mark.parametrize("name", ALL)
def test_example_validates(name, tmp_path):
    proc = cli(["validate", str(PLAYBOOKS / name)], {"NOETL_HOME": str(tmp_path / "home")})
    assert proc.returncode == 0, proc.stderr
    assert "valid" in proc.stdout


@pytest.mark.parametrize("name", STANDALONE)
def test_standalone_example_runs_to_completion(name, tmp_path):
    outcome = run(PLAYBOOKS / name, tmp_path)
    for step, expected in EXPECTED[name].items():
        assert outcome["results"][step] == expected, step


def test_run_json_prints_the_outcome_of_a_parallel_loop(tmp_path):
    proc = cli(
        ["run", "--json", "--timeout", str(RUN_TIMEOUT), str(PLAYBOOKS / "loop_parallel.yaml")],
        {"NOETL_HOME": str(tmp_path / "home")},
        timeout=RUN_TIMEOUT + 60,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip(), "`noetl-celery run --json` printed nothing"
    assert json.loads(proc.stdout)["results"]["summary"] == EXPECTED["loop_parallel.yaml"]["summary"]


def test_hello_world_takes_the_short_branch_for_a_short_message(tmp_path):
    outcome = run(PLAYBOOKS / "hello_world.yaml", tmp_path, "message=Hi")
    assert outcome["results"]["end"] == {"greeting": "Hi", "branch": "short"}
    assert "long_greeting" not in outcome["results"]


def test_branching_routes_a_small_export_order_through_customs(tmp_path):
    outcome = run(PLAYBOOKS / "branching.yaml", tmp_path, "amount=40", "country=FR")
    assert outcome["results"]["done"] == {"route": "auto", "customs": "declared"}
    assert "approve_manually" not in outcome["results"]


def test_http_mock_example_against_the_bundled_mock_api(tmp_path):
    with start_mock_api() as api:
        outcome = run(PLAYBOOKS / "http_mock.yaml", tmp_path, f"api_url={api.url}")
    assert outcome["results"]["summarize"] == {"flaky_status": 200, "items": 35, "first_id": 1, "last_id": 35}


def test_http_mock_retry_rows_name_the_retry_that_scheduled_them(tmp_path):
    with start_mock_api() as api:
        outcome = run(PLAYBOOKS / "http_mock.yaml", tmp_path, f"api_url={api.url}")
    home = {"NOETL_HOME": str(tmp_path / "home")}
    events = cli(["events", "--json", str(outcome["execution_id"])], home)
    rows = json.loads(events.stdout)
    keys = {row["event_id"]: row for row in rows}
    (retried,) = [r for r in rows if r["step"] == "fetch_flaky" and r["event_type"] == "action.completed"]
    assert retried["attempt"] == 2
    assert keys[retried["parent_event_id"]]["event_type"] == "action.started"  # the first attempt's start
    assert keys[retried["meta"]["retry_of"]]["event_type"] == "retry.scheduled"


def test_postgres_example_against_a_fresh_database(tmp_path, fresh_postgres):
    env = {"NOETL_AUTH_PG_LOCAL": fresh_postgres.dsn}
    first = run(PLAYBOOKS / "postgres_example.yaml", tmp_path, env=env)
    assert first["results"]["end"] == {"loaded": 4, "low_stock": ["B-200", "D-400"]}
    again = run(PLAYBOOKS / "postgres_example.yaml", tmp_path, env=env)  # upserts: same answer
    assert again["results"]["end"] == first["results"]["end"]


def test_cursor_redis_stream_example_against_this_sessions_redis(tmp_path, redis_url):
    stream = f"test:example:{tmp_path.name}"
    outcome = run(PLAYBOOKS / "cursor_redis_stream.yaml", tmp_path, f"redis_url={redis_url}", f"stream={stream}")
    assert outcome["results"]["report"] == {
        "done": 40,
        "each_once": True,
        "sum_of_squares": sum(n * n for n in range(1, 41)),
        "dead_letter": [],
        "pending": 0,
        "stats": {"processed": 40, "failed": 0, "slots": 4},
    }


def test_the_readme_quick_start_runs_the_demo_and_the_ci_test_command():
    readme = (REPO_ROOT / "README.md").read_text(encoding="utf-8")
    assert readme.index("## Quick start") < readme.index("```")  # its block is the README's first
    fenced = readme.split("## Quick start", 1)[1].split("```", 2)[1]
    _info, content = fenced.split("\n", 1)
    assert content.rstrip("\n").splitlines() == [
        "python -m pip install -q -e . && noetl-celery run playbooks/hello_world.yaml",
        "python -m pip install -q -e '.[test]' && python -m pytest -q -n 4 --dist worksteal",
    ]
    assert "python -m pip install -q -e '.[test]' && python -m pytest -q -n 4 --dist worksteal" in (
        REPO_ROOT / ".ci" / "run"
    ).read_text(encoding="utf-8")
