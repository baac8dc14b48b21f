"""The shell tool through the whole engine: NoETL's forms, a result the next step reads, a
credential that reaches the program only as an environment variable and is masked in every event
row, and a non-zero exit that fails the execution with error kind `shell` (on the harness, and
through real workers on Redis + PostgreSQL)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.e2e.conftest import API_TOKEN

PLAYBOOKS = Path(__file__).resolve().parents[1] / "playbooks"


@pytest.mark.smoke
def test_shell_forms_run_and_the_next_step_reads_their_output(engine):
    run = engine.run(PLAYBOOKS / "shell_tools.yaml")
    assert run.returncode == 0, (run.status.get("error"), run.stderr)
    start = run.results["start"]
    assert start["returncode"] == 0 and start["exit_code"] == 0
    assert start["stdout"] == "hello from tmp\n"
    assert start["stderr"] == "token=***\n"  # the credential's value, masked
    assert [c["cmd_preview"] for c in start["commands"]][0] == 'echo "$GREETING from $(basename "$PWD")"'
    assert [c["returncode"] for c in start["commands"]] == [0, 0, 0]
    assert run.results["shout"]["stdout"] == "14 HELLO FROM TMP\n"
    rows = json.dumps(engine.events(run.execution_id), default=str)
    assert API_TOKEN not in rows


@pytest.mark.smoke
def test_a_non_zero_exit_fails_the_step_with_kind_shell(engine):
    run = engine.run(PLAYBOOKS / "shell_fails.yaml")
    assert run.returncode != 0
    failed = [e for e in engine.events(run.execution_id) if e["event_type"] == "action.failed"]
    assert len(failed) == 1, failed
    error = failed[0]["error"]
    assert error["kind"] == "shell" and error["returncode"] == 3
    assert (
        error["message"]
        == 'shell: command exited with returncode=3: echo "about to fail"; echo "disk full" >&2; exit 3 (disk full)'
    )
    data = failed[0]["result"] if "result" in failed[0] else failed[0].get("data")
    assert data["returncode"] == 3 and data["stdout"] == "about to fail\n" and len(data["commands"]) == 1
