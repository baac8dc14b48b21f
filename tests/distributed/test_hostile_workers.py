"""Real workers against hostile templates and an unusable store.

- A power or string-repeat bomb in a task's args or in a `when:` fails in seconds with error kind
  `template`, and the same worker then runs the next execution to completion.
- A worker whose store refuses it (unknown database or role) stops at start with one line,
  instead of reporting ready and retrying every event.
"""

from __future__ import annotations

import json

import pytest

from noetl_celery.store.check import safe_url
from tests.support.engines import cli
from tests.support.workers import WorkerStartError

ARGS_BOMB = """apiVersion: noetl.io/v2
kind: Playbook
metadata: {name: args_bomb}
workflow:
  - step: start
    tool:
      kind: python
      args: {n: "{{ BOMB }}"}
      code: "result = n"
"""
WHEN_BOMB = """apiVersion: noetl.io/v2
kind: Playbook
metadata: {name: when_bomb}
workflow:
  - step: start
    tool: {kind: python, code: "result = 1"}
    next:
      arcs:
        - step: after
          when: "{{ BOMB }}"
  - step: after
    tool: {kind: python, code: "result = 2"}
"""
FINE = """apiVersion: noetl.io/v2
kind: Playbook
metadata: {name: fine}
workflow:
  - step: start
    tool: {kind: python, code: "result = 40 + 2"}
"""
BOMBS = {"power": "(9 ** (9 ** 9)) > 1", "repeat": "('x' * (10 ** 10)) | length > 1"}
RUN_TIMEOUT = 120  # seconds; a bomb that hangs the worker would exhaust it


def _submit(tmp_path, env, name: str, text: str) -> dict:
    playbook = tmp_path / f"{name}.yaml"
    playbook.write_text(text)
    proc = cli(["submit", "--wait", "--json", "--timeout", str(RUN_TIMEOUT), str(playbook)], env)
    return json.loads(proc.stdout)


@pytest.mark.timeout(900)
def test_template_bombs_fail_the_attempt_and_the_worker_serves_the_next_task(tmp_path, env, worker_factory):
    worker_factory(env=env, concurrency=1)
    for bomb_name, bomb in BOMBS.items():
        status = _submit(tmp_path, env, f"args_{bomb_name}", ARGS_BOMB.replace("BOMB", bomb))
        assert status["status"] == "failed", status
        assert status["error"]["kind"] == "template" and "more than the template limit of" in status["error"]["message"]
        status = _submit(tmp_path, env, f"when_{bomb_name}", WHEN_BOMB.replace("BOMB", bomb))
        assert status["status"] == "failed", status
        assert "more than the template limit of" in json.dumps(status["error"])
        assert "after" not in status["results"]
    status = _submit(tmp_path, env, "fine", FINE)
    assert status["status"] == "completed" and status["results"]["start"] == 42


UNSTORABLE = """apiVersion: noetl.io/v2
kind: Playbook
metadata: {name: unstorable}
workflow:
  - step: start
    tool: {kind: python, code: "result = {'values': [1.0, float('nan')], 'text': 'a' + chr(0)}"}
    next: {arcs: [{step: after}]}
  - step: after
    tool: {kind: python, code: "result = 2"}
"""


@pytest.mark.timeout(300)
def test_a_result_postgresql_refuses_fails_one_attempt_at_once(tmp_path, env, worker_factory, store_url):
    """NaN and NUL in a result: one `invalid_result` attempt naming the value, decided at once;
    not a store outage re-sent with growing delays, nor re-published by the sweeper as lost."""
    from noetl_celery.store import repo
    from noetl_celery.store.db import transaction

    worker_factory(env=env, concurrency=1)
    status = _submit(tmp_path, env, "unstorable", UNSTORABLE)
    assert status["status"] == "failed", status
    assert status["error"]["kind"] == "invalid_result", status["error"]
    assert "NaN (JSON has no NaN or Infinity) at result.values[1]" in status["error"]["message"]
    assert "after" not in status["results"]
    with transaction(store_url) as conn:
        events = repo.list_events(conn, int(status["execution_id"]))
    types = [e["event_type"] for e in events]
    assert types.count("action.failed") == 1 and "attempt.republished" not in types, types
    started = min(e["created_at"] for e in events)
    assert (max(e["created_at"] for e in events) - started).total_seconds() < 10  # no outage delays


@pytest.mark.parametrize("what", ["database", "role"])
def test_a_worker_refused_by_its_store_stops_with_one_line(store_url, worker_factory, what):
    bad = (
        store_url.rsplit("/", 1)[0] + "/no_such_database_4711"
        if what == "database"
        else store_url.replace("postgres@", "no_such_role_4711@").replace("postgres:", "no_such_role_4711:")
    )
    assert bad != store_url
    worker = worker_factory(env={"NOETL_DATABASE_URL": bad}, start=False)
    with pytest.raises(WorkerStartError) as info:
        worker.start(timeout=60)
    assert "before it was ready" in str(info.value)
    lines = [line for line in worker.log_text().splitlines() if "noetl_celery: event store at" in line]
    assert lines, worker.log_tail()
    assert f"event store at {safe_url(bad)}: " in lines[0]
    assert (
        ('database "no_such_database_4711" does not exist' in lines[0])
        if what == "database"
        else ("no_such_role_4711" in lines[0])
    )
    assert "Traceback" not in worker.log_text()
