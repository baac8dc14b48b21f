"""Debugging a failure and navigating big runs from the command line: the failing attempt's
rendered arguments and output in `status`, the parameters, `events` filters, and `events`
written as it is read (bounded memory on a log of thousands of rows, SQLite and PostgreSQL)."""

from __future__ import annotations

import contextlib
import json
import tracemalloc
from pathlib import Path

import pytest
from click.testing import CliRunner

from noetl_celery import cli as cli_module
from noetl_celery.compiler import compile_playbook
from noetl_celery.runner import create_execution
from noetl_celery.store import repo
from noetl_celery.store.db import ensure_schema, transaction
from tests.support.engines import cli

PLAYBOOKS = Path(__file__).resolve().parent / "playbooks"
SECRET = "s3cr3t-token-value"  # a configured credential value (NOETL_AUTH_API_TOKEN)
BIG_EVENTS = 3000  # rows of the execution built in the store for the streaming test
ROW_PAYLOAD = 2000  # characters of each such row's result


@pytest.fixture(scope="module")
def failed_run(tmp_path_factory):
    """An embedded run of debug_failure whose only step fails (divisor=0 given with --set)."""
    home = tmp_path_factory.mktemp("debugging") / "home"
    env = {"NOETL_HOME": str(home), "NOETL_AUTH_API_TOKEN": SECRET}
    proc = cli(
        ["run", str(PLAYBOOKS / "debug_failure.yaml"), "--json", "--set", "divisor=0", "--set", f"note=uses {SECRET}"],
        env,
    )
    assert proc.returncode == 1, proc.stderr
    return env, int(json.loads(proc.stdout)["execution_id"])


def test_status_shows_the_failing_attempts_rendered_input_its_output_and_the_parameters(failed_run):
    env, execution_id = failed_run
    status = cli(["status", str(execution_id)], env)
    assert status.returncode == 1, status.stderr
    out = status.stdout
    assert "failing attempt: step start attempt 1" in out, out
    assert 'input: {"d": 0, "who": "hello world", "password": "***", "note": "uses ***"}' not in out  # nested
    assert 'input: {"args": {"d": 0, "who": "hello world", "password": "***", "note": "uses ***"}}' in out, out
    assert "    stdout| computing with 0" in out and "    stderr| about to divide" in out
    assert "    log| WARNING mine: divisor is 0" in out
    assert SECRET not in out and "pw-not-shown" not in out
    as_json = json.loads(cli(["status", str(execution_id), "--json"], env).stdout)
    assert as_json["workload"] == {"divisor": 0, "greeting": "hello", "password": "***", "note": "uses ***"}
    failure = as_json["failure"]
    assert failure["input"]["args"]["d"] == 0 and failure["element"] is None
    assert (failure["stdout"], failure["stderr"], failure["log"]) == (
        "computing with 0\n",
        "about to divide\n",
        ["WARNING mine: divisor is 0"],
    )


def test_events_filters_and_the_attempts_output(failed_run):
    env, execution_id = failed_run
    table = cli(["events", str(execution_id)], env)
    assert table.returncode == 0, table.stderr
    lines = table.stdout.splitlines()
    failed_at = next(i for i, line in enumerate(lines) if " action.failed " in line)
    assert lines[failed_at + 1 : failed_at + 4] == [
        "      stdout| computing with 0",
        "      stderr| about to divide",
        "      log| WARNING mine: divisor is 0",
    ]
    every = json.loads(cli(["events", str(execution_id), "--json"], env).stdout)
    assert [r["event_type"] for r in every][0] == "execution.started" and len(every) == 6

    runner = CliRunner()

    def rows(*args: str) -> list[dict]:  # in-process: the same command, without a process each
        result = runner.invoke(cli_module.cli, ["events", str(execution_id), "--json", *args], env=env)
        assert result.exit_code == 0, result.output
        return json.loads(result.stdout)

    assert [r["event_type"] for r in rows("--type", "action.failed")] == ["action.failed"]
    assert [r["event_type"] for r in rows("--type", "step.started", "--type", "step.failed")] == [
        "step.started",
        "step.failed",
    ]
    assert {r["step"] for r in rows("--step", "start")} == {"start"} and len(rows("--step", "start")) == 5
    assert [r["id"] for r in rows("--limit", "2")] == [r["id"] for r in every[:2]]
    assert [r["id"] for r in rows("--since", str(every[3]["id"]))] == [r["id"] for r in every[4:]]
    assert len(rows("--since", "1h")) == 6 and rows("--since", "2999-01-01T00:00:00") == []
    assert rows("--step", "nowhere") == []
    followed = runner.invoke(
        cli_module.cli, ["events", str(execution_id), "--follow", "--json", "--type", "action.failed"], env=env
    )  # the execution has ended: the matching rows, then the command returns
    assert followed.exit_code == 0, followed.output
    assert [json.loads(line)["event_type"] for line in followed.stdout.splitlines()] == ["action.failed"]
    bad = runner.invoke(cli_module.cli, ["events", str(execution_id), "--since", "yesterday"], env=env)
    assert bad.exit_code == 2 and "--since" in bad.output
    unknown = cli(["events", "12345", "--json"], env)
    assert unknown.returncode == 2 and "no execution 12345" in unknown.stderr


def test_executions_playbook_filter_matches_a_part_of_the_name(failed_run):
    env, execution_id = failed_run
    listed = json.loads(cli(["executions", "--json", "--playbook", "BUG_fail"], env).stdout)
    assert [r["execution_id"] for r in listed] == [execution_id]
    assert json.loads(cli(["executions", "--json", "--playbook", "bug%"], env).stdout) == []  # % is a character


def build_big_execution(url: str) -> int:
    """An execution with BIG_EVENTS rows of ROW_PAYLOAD characters each, written directly."""
    ensure_schema(url)
    execution_id = create_execution(compile_playbook(str(PLAYBOOKS / "loop_many.yaml")), url)
    rows = [
        {
            "execution_id": execution_id,
            "event_id": f"big.{n}",
            "event_type": "iteration.completed",
            "status": "completed",
            "step": "work",
            "iteration": n,
            "result": {"n": n, "text": f"{n:06d}" + "x" * ROW_PAYLOAD},
        }
        for n in range(BIG_EVENTS)
    ]
    with transaction(url) as conn:
        repo.insert_events(conn, rows)
    return execution_id


def test_events_json_is_written_as_it_is_read_in_bounded_memory(either_store, tmp_path, monkeypatch):
    """`events --json` of a few thousand rows: the output is the whole log, and the memory the
    command allocates at its peak is a small part of it (the rows are never all held at once)."""
    execution_id = build_big_execution(either_store)
    monkeypatch.setenv("NOETL_DATABASE_URL", either_store)
    out = tmp_path / "events.json"
    tracemalloc.start()
    try:
        with out.open("w") as sink, contextlib.redirect_stdout(sink):
            cli_module.cli.main(["events", str(execution_id), "--json"], standalone_mode=False)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    written = out.stat().st_size
    rows = json.loads(out.read_text())
    assert len(rows) == BIG_EVENTS and [r["iteration"] for r in rows] == list(range(BIG_EVENTS))
    assert written > BIG_EVENTS * ROW_PAYLOAD
    # holding the rows (as dicts, then as one JSON text) needs several times `written`
    assert peak < written / 4, f"peak {peak} bytes for {written} bytes written"


def test_a_failed_attempts_shown_input_is_masked_before_it_is_capped(monkeypatch):
    """The rendered arguments kept with a failed attempt: raw fields left out, secret-named keys,
    the credential's values and configured secrets masked, each value capped; a secret at the
    edge of a truncated preview is masked first, so no part of it is kept."""
    from noetl_celery.config.limits import PREVIEW_CHARS, is_truncated
    from noetl_celery.engine.attempt.worker import INPUT_VALUE_BYTES, shown_input

    monkeypatch.setenv("NOETL_AUTH_API_TOKEN", SECRET)
    long_text = "a" * (PREVIEW_CHARS - 5) + SECRET + "b" * INPUT_VALUE_BYTES  # the secret crosses the preview's end
    shown = shown_input(
        {
            "code": "print('the playbook text')",
            "args": {"password": "pw-1", "dsn": "host=db password=cred-value-9"},
            "body": long_text,
        },
        frozenset({"code"}),
        {"cred-value-9"},
    )
    assert "code" not in shown
    assert shown["args"] == {"password": "***", "dsn": "host=db password=***"}
    assert is_truncated(shown["body"]) and "s3cr" not in json.dumps(shown)
