"""Rerun (engine/recovery/rerun.py, runner.rerun, `noetl-celery rerun`): a new execution made from an old
one. In-process (the harness) for what it keeps and where it starts; the command line on the
embedded default once."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from noetl_celery import runner
from noetl_celery.compiler import compile_playbook
from noetl_celery.core.errors import ExecutionNotFound
from noetl_celery.engine.recovery import rerun as reruns
from noetl_celery.replay import ReplayError, replay
from noetl_celery.store import repo
from noetl_celery.store.db import transaction
from tests.support.engines import cli
from tests.support.harness import Harness

# start -> fetch -> total -> report. `total` of version 1 has a bug; version 2 (same path) fixes
# it. Each tool appends its step's name to the file `trail`, so a run that is not re-run leaves
# no line. `fetch` sets ctx and vars that `total` reads.
V1_TOTAL = "raise ValueError('bug in total: ' + str(value))"
V2_TOTAL = "result = {'sum': value + bonus}"


def ledger(total_code: str, path: str = "tests/rerun_ledger") -> str:
    return f"""apiVersion: noetl.io/v10
kind: Playbook
metadata: {{name: rerun_ledger, path: {path}}}
workload: {{trail: /dev/null, base: 10, bonus: 1}}
workflow:
  - step: start
    tool: {{kind: python, args: {{trail: "{{{{ trail }}}}", base: "{{{{ base }}}}"}}, code: "open(trail, 'a').write('start\\\\n'); result = {{'base': base}}"}}
    next:
      arcs: [{{step: fetch}}]
  - step: fetch
    tool: {{kind: python, args: {{trail: "{{{{ trail }}}}", base: "{{{{ start.base }}}}"}}, code: "open(trail, 'a').write('fetch\\\\n'); result = {{'value': base * 2}}"}}
    set: {{fetched: true}}
    vars: {{seen: "{{{{ result.value }}}}"}}
    next:
      arcs: [{{step: total, args: {{extra: 5}}}}]
  - step: total
    tool:
      kind: python
      args: {{trail: "{{{{ trail }}}}", value: "{{{{ fetch.value + args.extra }}}}", bonus: "{{{{ bonus }}}}", seen: "{{{{ vars.seen }}}}", fetched: "{{{{ ctx.fetched }}}}"}}
      code: "open(trail, 'a').write('total\\\\n'); {total_code}"
    next:
      arcs: [{{step: report}}]
  - step: report
    tool: {{kind: python, args: {{trail: "{{{{ trail }}}}", total: "{{{{ total.sum }}}}", came: "{{{{ result.sum }}}}"}}, code: "open(trail, 'a').write('report\\\\n'); result = {{'total': total, 'came': came}}"}}
"""


def run_failed(url: str, trail: Path) -> int:
    runner.register_text(ledger(V1_TOTAL), url, "v1")
    plan = runner.compile_registered("tests/rerun_ledger", {"trail": str(trail)}, url)
    harness = Harness(url)
    status = harness.run(plan)
    assert status["status"] == "failed" and status["failed_step"] == "total", status
    assert trail.read_text().split() == ["start", "fetch", "total"]
    return int(status["execution_id"])


def rerun_here(url: str, execution_id: int, overrides=None, **kwargs) -> dict:
    """runner.rerun's decision, its dispatches run by the harness."""
    plan, made = runner.prepare_rerun(url, execution_id, overrides or {}, **kwargs)
    new_id, dispatches = runner.create_started(plan, url, lambda c, s, row: reruns.start(c, s, row, made))
    harness = Harness(url)
    harness.send(dispatches)
    harness.drain()
    return runner.execution_status(url, new_id)


def rows(url: str, execution_id: int) -> list[dict]:
    with transaction(url) as conn:
        return repo.list_events(conn, execution_id)


def test_rerun_from_the_failed_step_with_the_fixed_version_keeps_the_steps_before_it(either_store, tmp_path):
    url = either_store  # SQLite and PostgreSQL
    trail = tmp_path / "trail"
    old = run_failed(url, trail)
    runner.register_text(ledger(V2_TOTAL), url, "v2")
    trail.write_text("")

    status = rerun_here(url, old, from_step="total", latest=True)

    assert status["status"] == "completed", status
    assert status["rerun_of"] == old and status["from_step"] == "total"
    # only the failed step and what follows it ran; it read the kept results, ctx, vars and args
    assert trail.read_text().split() == ["total", "report"]
    assert status["results"]["total"] == {"sum": 26}  # (10 * 2 + 5) + 1
    assert status["results"]["report"] == {"total": 26, "came": 26}
    assert status["results"]["fetch"] == {"value": 20} and status["results"]["start"] == {"base": 10}
    assert status["ctx"]["fetched"] is True and status["vars"]["seen"] == 20
    events = rows(url, status["execution_id"])
    started = events[0]
    assert started["event_type"] == "execution.started"
    assert started["meta"]["rerun_of"] == old and started["meta"]["from_step"] == "total"
    assert started["meta"]["plan"] == "catalog" and started["meta"]["registered_at"]
    assert started["meta"]["seeded"] == ["fetch", "start"]
    seeded = [e for e in events if (e["meta"] or {}).get("seeded_from") == old]
    assert [(e["event_type"], e["step"]) for e in seeded] == [("step.completed", "start"), ("step.completed", "fetch")]
    attempted = {e["step"] for e in events if e["event_type"].startswith("action.")}
    assert attempted == {"total", "report"}
    assert {e["step"] for e in events if e["event_type"] == "step.started"} == {"total", "report"}
    # the old execution is left as it was
    assert runner.execution_status(url, old)["status"] == "failed"
    # replay decides an execution's start again through on_event: a rerun's start is not that
    with pytest.raises(ReplayError, match=f"is a rerun of {old}"):
        replay(url, status["execution_id"])


def test_rerun_from_a_step_with_the_stored_plan_runs_the_old_code_again(sqlite_url, tmp_path):
    trail = tmp_path / "trail"
    old = run_failed(sqlite_url, trail)
    runner.register_text(ledger(V2_TOTAL), sqlite_url, "v2")  # not used without latest
    trail.write_text("")
    status = rerun_here(sqlite_url, old, from_step="total", latest=False)
    assert status["status"] == "failed" and status["failed_step"] == "total"
    assert "bug in total: 25" in json.dumps(status["error"])
    assert trail.read_text().split() == ["total"]
    started = rows(sqlite_url, status["execution_id"])[0]
    assert started["meta"]["plan"] == "stored" and "registered_at" not in started["meta"]


def test_a_whole_rerun_runs_every_step_with_the_old_parameters_overridden(sqlite_url, tmp_path):
    trail = tmp_path / "trail"
    old = run_failed(sqlite_url, trail)
    runner.register_text(ledger(V2_TOTAL), sqlite_url, "v2")
    trail.write_text("")
    status = rerun_here(sqlite_url, old, {"bonus": 100}, from_step=None, latest=True)
    assert status["status"] == "completed", status
    assert status["rerun_of"] == old and status["from_step"] is None
    assert trail.read_text().split() == ["start", "fetch", "total", "report"]
    assert status["results"]["total"] == {"sum": 125}
    with transaction(sqlite_url) as conn:
        new = repo.get_execution(conn, status["execution_id"])
    # the old parameters (trail, given when it ran) kept; bonus overridden
    assert new["workload"]["trail"] == str(trail) and new["workload"]["bonus"] == 100
    assert not [e for e in rows(sqlite_url, status["execution_id"]) if (e["meta"] or {}).get("seeded_from")]


def test_a_rerun_that_cannot_be_made_is_refused_naming_why(sqlite_url, tmp_path):
    old = run_failed(sqlite_url, tmp_path / "trail")
    cases = {
        "nope": ("from_step", "has no step 'nope'"),
        "report": ("from_step", "step 'report' never started"),
    }
    for step, (field, message) in cases.items():
        with pytest.raises(reruns.RerunRefused) as refused:
            runner.prepare_rerun(sqlite_url, old, {}, from_step=step, latest=False)
        assert refused.value.field == field and message in str(refused.value)
    with pytest.raises(ExecutionNotFound):
        runner.prepare_rerun(sqlite_url, 424242, {}, from_step=None, latest=False)

    plain = compile_playbook("unregistered", text=ledger(V2_TOTAL, path="tests/elsewhere"))
    running = runner.create_execution(plain, sqlite_url)
    with pytest.raises(reruns.RerunRefused) as refused:
        runner.prepare_rerun(sqlite_url, running, {}, from_step=None, latest=True)
    assert refused.value.field == "latest" and "not registered" in str(refused.value)
    with pytest.raises(reruns.RerunRefused) as refused:
        runner.prepare_rerun(sqlite_url, running, {}, from_step="total", latest=False)
    assert "still running" in str(refused.value)


def test_the_rerun_command_on_the_embedded_default(tmp_path):
    """`noetl-celery rerun ID --from STEP --latest --set k=v --json` runs the rerun here to its end
    (the failed execution is made in-process, in the command's store)."""
    home = tmp_path / "home"
    home.mkdir()
    url = f"sqlite:///{home / 'noetl.sqlite'}"
    trail = tmp_path / "trail"
    old = run_failed(url, trail)
    runner.register_text(ledger(V2_TOTAL), url, "v2")

    again = cli(
        ["rerun", str(old), "--from", "total", "--latest", "--set", "bonus=2", "--json", "-q"],
        {"NOETL_HOME": str(home)},
    )
    assert again.returncode == 0, again.stderr
    status = json.loads(again.stdout)
    assert status["status"] == "completed" and status["rerun_of"] == old and status["from_step"] == "total"
    assert status["results"]["total"] == {"sum": 27}
    assert f"execution {status['execution_id']}: rerun of {old}" in again.stderr
    assert trail.read_text().split() == ["start", "fetch", "total", "total", "report"]


def test_the_launch_form_is_built_from_the_workload_and_sends_only_what_changed():
    import tornado.web

    from noetl_celery.dashboard.launch import assignments, changed_values, workload_fields

    workload = {"name": "x", "n": 3, "flags": [1, 2], "db": {"host": "h", "password": "pw"}, "empty": {}}
    fields = workload_fields(workload)
    shown = {f.label: (f.text, f.is_text, f.secret) for f in fields}
    assert shown == {
        "name": ("x", True, False),
        "n": ("3", False, False),
        "flags": ("[1, 2]", False, False),
        "db.host": ("h", True, False),
        "db.password": ("", True, True),  # a secret is never shown
        "empty": ("{}", False, False),
    }
    form = {f.name: f.text for f in fields}
    assert changed_values(fields, form) == {}  # defaults sent back, the secret left empty: no override
    by_label = {f.label: f.name for f in fields}
    form |= {by_label["n"]: "4", by_label["flags"]: "[3]", by_label["db.password"]: "new", by_label["name"]: "007"}
    assert changed_values(fields, form) == {"n": 4, "flags": [3], "db": {"password": "new"}, "name": "007"}
    with pytest.raises(tornado.web.HTTPError) as bad:
        changed_values(fields, {**form, by_label["flags"]: "[3"})
    assert bad.value.status_code == 400 and "flags" in bad.value.reason

    assert assignments("a.b=1\n\n c=true \n", "more") == {"a": {"b": 1}, "c": True}
    with pytest.raises(tornado.web.HTTPError) as bad:
        assignments("novalue", "more")
    assert bad.value.status_code == 400 and "key=value" in bad.value.reason


def test_the_rerun_command_refuses_before_starting_anything(sqlite_url, tmp_path, monkeypatch):
    from click.testing import CliRunner

    from noetl_celery.cli import cli as command

    old = run_failed(sqlite_url, tmp_path / "trail")
    monkeypatch.setenv("NOETL_DATABASE_URL", sqlite_url)
    monkeypatch.delenv("NOETL_BROKER_URL", raising=False)
    before = len(runner.execution_tree(sqlite_url, limit=100))
    for args, message in (
        (["--from", "nope"], "from_step: the playbook has no step 'nope'"),
        (["--from", "report"], "never started in execution"),
        (["--set", "novalue"], "expected key=value"),
    ):
        result = CliRunner().invoke(command, ["rerun", str(old), *args, "-q"])
        assert result.exit_code == 2 and message in result.output, result.output
    assert CliRunner().invoke(command, ["rerun", "424242"]).exit_code == 2
    assert len(runner.execution_tree(sqlite_url, limit=100)) == before


def test_the_forms_are_offered_only_with_the_token_where_executions_run(sqlite_url, tmp_path):
    """The dashboard's pages in-process: the rerun and launch forms need NOETL_DASHBOARD_TOKEN and
    a server whose executions run; where they are not offered a POST is refused."""
    import asyncio

    import tornado.httpclient
    import tornado.httpserver

    from noetl_celery.config import settings as noetl_settings
    from noetl_celery.dashboard.server import make_app
    from tests.support.services import free_port

    old = run_failed(sqlite_url, tmp_path / "trail")
    running = runner.create_execution(compile_playbook("plain", text=ledger(V2_TOTAL)), sqlite_url)
    bearer = {"Authorization": "Bearer t0ken"}

    async def pages(token: str | None, runs: bool, posts: bool = True) -> dict[str, tuple[int, str]]:
        environ = {"NOETL_DATABASE_URL": sqlite_url, **({"NOETL_DASHBOARD_TOKEN": token} if token else {})}
        port = free_port()
        server = tornado.httpserver.HTTPServer(make_app(noetl_settings.load(environ), runs=runs))
        server.listen(port, "127.0.0.1")
        client = tornado.httpclient.AsyncHTTPClient(force_instance=True)
        got = {}
        try:
            for name, path, method in (
                ("failed", f"/executions/{old}", "GET"),
                ("running", f"/executions/{running}", "GET"),
                ("playbook", "/playbooks/tests/rerun_ledger", "GET"),
                ("catalog", "/playbooks", "GET"),
                ("rerun", f"/executions/{old}/rerun", "POST"),
                ("launch", "/playbooks/tests/rerun_ledger", "POST"),
            ):
                if method == "POST" and not posts:
                    continue
                response = await client.fetch(
                    f"http://127.0.0.1:{port}{path}",
                    method=method,
                    body="from_step=total" if method == "POST" else None,
                    headers=bearer,
                    raise_error=False,
                    follow_redirects=False,
                )
                got[name] = (response.code, (response.body or b"").decode() or response.reason)
        finally:
            client.close()
            server.stop()
        return got

    offered = asyncio.run(pages("t0ken", runs=True, posts=False))
    assert 'class="rerun-from" name="from_step" value="total"' in offered["failed"][1]
    assert 'id="rerun"' not in offered["running"][1]  # not while it runs
    assert (
        'id="launch-button"' in offered["playbook"][1]
        and 'href="/playbooks/tests/rerun_ledger"' in offered["catalog"][1]
    )

    for token, runs, refused in (("t0ken", False, 503), (None, True, 403)):
        got = asyncio.run(pages(token, runs))
        assert 'id="rerun"' not in got["failed"][1] and 'id="launch-button"' not in got["playbook"][1]
        assert got["playbook"][0] == 200 and "launching needs" in got["playbook"][1]
        assert got["rerun"][0] == refused and got["launch"][0] == refused, got
    assert len(runner.execution_tree(sqlite_url, limit=100)) == 2  # nothing was started
