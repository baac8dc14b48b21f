"""NoETL fidelity, the second round: forms and keys real NoETL playbooks use, each from a minimal
playbook that shows it (the conformance gaps m06, m08, m10, m11, m12, m13, m15 and the ones seen
across real files), run in-process on the harness; the postgres ones on a real PostgreSQL."""

from __future__ import annotations

import textwrap
from pathlib import Path
from typing import Any

import pytest

from noetl_celery import runner
from noetl_celery.compiler import compile_source
from noetl_celery.core.errors import PlaybookError
from tests.support.harness import run_playbook
from tests.test_noetl_fidelity import M15_TASK_OUTPUT  # the m15 playbook, compiled there, run here


def _write(tmp_path: Path, text: str, name: str = "pb.yaml") -> Path:
    tmp_path.mkdir(parents=True, exist_ok=True)
    path = tmp_path / name
    path.write_text(textwrap.dedent(text))
    return path


def _run(url: str, tmp_path: Path, text: str, **kwargs: Any) -> dict[str, Any]:
    code, status = run_playbook(url, _write(tmp_path, text), **kwargs)
    assert (code, status["status"]) == (0, "completed"), status["error"]
    return status


def _attempts(url: str, execution_id: int, step: str) -> list[dict[str, Any]]:
    return [
        row
        for row in runner.execution_events(url, execution_id)
        if row["event_type"].startswith("action.") and row.get("step") == step and row["event_type"] != "action.started"
    ]


# --- python libs: {Name: {from, import}}, a list of pip names ---------------------------------

M06_LIBS_FROM = """
apiVersion: noetl.io/v2
kind: Playbook
metadata: {name: m06}
workflow:
  - step: start
    tool:
      kind: python
      libs: {Decimal: {from: decimal, import: Decimal}, b64: base64, PurePath: {from: pathlib, import: PurePath}}
      code: "result = [str(Decimal('1.5')), b64.b64encode(b'a').decode(), PurePath('/a/b').name]"
"""

M10_LIBS_LIST_PIP = """
apiVersion: noetl.io/v2
kind: Playbook
metadata: {name: m10}
workflow:
  - step: start
    tool:
      kind: python
      libs: [psycopg2-binary, "requests>=2", json]
      code: |
        import psycopg2
        result = [psycopg2.__name__, json.dumps(1)]
"""


def test_python_libs_from_import_binds_the_name(sqlite_url, tmp_path):
    status = _run(sqlite_url, tmp_path, M06_LIBS_FROM)
    assert status["results"]["start"] == ["1.5", "YQ==", "b"]


def test_python_libs_from_import_names_what_cannot_be_imported(sqlite_url, tmp_path):
    text = M06_LIBS_FROM.replace("import: PurePath}", "import: NoSuchName}")
    code, status = run_playbook(sqlite_url, _write(tmp_path, text))
    assert (code, status["status"]) == (1, "failed")
    assert "cannot import name 'NoSuchName' from 'pathlib'" in status["error"]["message"]


def test_python_libs_list_of_pip_names_is_ignored_as_noetl_ignores_it(sqlite_url, tmp_path):
    status = _run(sqlite_url, tmp_path, M10_LIBS_LIST_PIP)
    assert status["results"]["start"] == ["psycopg2", "1"]  # `json` from the list is bound, as before
    (attempt,) = _attempts(sqlite_url, status["execution_id"], "start")
    assert attempt["meta"]["log"][0].endswith("ignored, as in NoETL): psycopg2-binary, requests>=2")


# --- kind: playbook with payload:/retry:, retry.retry_on, noop result: ----------------------------

M08_PLAYBOOK_PAYLOAD = """
apiVersion: noetl.io/v2
kind: Playbook
metadata: {name: m08}
workflow:
  - step: start
    tool:
      kind: playbook
      path: "{{ child }}"
      payload: {x: 1}
      retry: {max_attempts: 2}
"""

CHILD = """
apiVersion: noetl.io/v2
kind: Playbook
metadata: {name: child, path: tests/fidelity/child}
workload: {x: 0}
workflow:
  - step: start
    tool: {kind: python, input: {x: "{{ x }}"}, code: "result = {'x': x}"}
"""


def test_playbook_payload_is_the_childs_workload_and_retry_is_accepted(sqlite_url, tmp_path):
    _write(tmp_path, CHILD, "child.yaml")
    child = "tests/fidelity/child"
    status = _run(sqlite_url, tmp_path, M08_PLAYBOOK_PAYLOAD, sets={"child": child})
    assert status["results"]["start"] == {"start": {"x": 1}}  # the child's results, by step
    task = compile_source(str(tmp_path / "pb.yaml"), {"child": child}).steps["start"].tasks[0]
    assert (task.config["payload"], task.config["retry"]) == ({"x": 1}, {"max_attempts": 2})


@pytest.mark.parametrize(
    ("path", "hint"),
    [
        ("tests/fidelity/chlid", "; did you mean 'tests/fidelity/child'?"),
        ("chld", "; did you mean 'tests/fidelity/child' (child)?"),
        ("something/else/entirely", " (more directories: NOETL_PLAYBOOK_PATH)"),
    ],
)
def test_a_missing_sub_playbook_path_suggests_the_nearest(tmp_path, path, hint):
    _write(tmp_path, CHILD, "child.yaml")
    text = M08_PLAYBOOK_PAYLOAD.replace('"{{ child }}"', path)
    with pytest.raises(PlaybookError) as raised:
        compile_source(str(_write(tmp_path, text)))
    (problem,) = raised.value.problems
    assert problem.path == "start.tool.path" and problem.message.endswith(hint), problem.message


def test_a_missing_sub_playbook_path_suggests_a_registered_one(sqlite_url, tmp_path):
    child = _write(tmp_path / "elsewhere", CHILD.replace("tests/fidelity/child", "shared/reports/monthly"), "c.yaml")
    runner.register([str(child)], sqlite_url)
    text = M08_PLAYBOOK_PAYLOAD.replace('"{{ child }}"', "shared/reports/montly")
    with pytest.raises(PlaybookError, match="did you mean 'shared/reports/monthly'"):
        compile_source(str(_write(tmp_path, text)), {}, runner.catalog(sqlite_url))


def test_retry_on_is_accepted_and_every_error_is_still_retried(sqlite_url, tmp_path):
    text = """
    apiVersion: noetl.io/v1
    kind: Playbook
    metadata: {name: retry_on}
    workflow:
      - step: start
        tool: python
        code: |
          def main():
              raise ValueError("always")
        retry: {max_attempts: 3, initial_delay: 0.1, retry_on: [ConnectionError]}
    """
    code, status = run_playbook(sqlite_url, _write(tmp_path, text))
    assert (code, status["status"]) == (1, "failed")
    assert len(_attempts(sqlite_url, status["execution_id"], "start")) == 3


def test_noop_result_in_a_workbook_entry_is_accepted(sqlite_url, tmp_path):
    text = """
    apiVersion: noetl.io/v1
    kind: Playbook
    metadata: {name: noop_result}
    workbook:
      - name: mark
        tool: noop
        args: {a: 1}
        result: {status: ok}
    workflow:
      - step: start
        tool: workbook
        task: mark
        next: [{step: end}]
      - step: end
        tool: python
        code: "result = 'end'"
    """
    status = _run(sqlite_url, tmp_path, text)
    assert (status["results"]["start"], status["results"]["end"]) == ({"a": 1}, "end")
    assert compile_source(str(tmp_path / "pb.yaml")).steps["start"].tasks[0].hints == {"result": {"status": "ok"}}


# --- script source.endpoint over http -------------------------------------------------------------


def test_script_source_endpoint_is_fetched_over_http(sqlite_url, tmp_path, script_server):
    www = tmp_path / "www"
    (www / "hello_world.py").write_text("def main(name, count):\n    return {'hello': name, 'count': count}\n")
    text = f"""
    apiVersion: noetl.io/v2
    kind: Playbook
    metadata: {{name: m11}}
    workflow:
      - step: start
        tool:
          kind: python
          script:
            uri: hello_world.py
            source: {{type: http, endpoint: "{script_server}/hello_world.py"}}
          input: {{name: x, count: 1}}
    """
    status = _run(sqlite_url, tmp_path, text)
    assert status["results"]["start"] == {"hello": "x", "count": 1}


# --- workbook task:, step names success/error, a loop's step.data.results ---------------------------


@pytest.mark.parametrize(
    "call",
    [
        "tool: workbook\n        task: greet\n        args: {who: x}",
        "tool: workbook\n        task: greet\n        with: {who: x}",
        "tool: {kind: workbook, task: greet, args: {who: x}}",
        "tool: workbook\n        name: greet\n        args: {who: x}",
    ],
)
def test_workbook_task_key_names_the_entry(sqlite_url, tmp_path, call):
    text = f"""
    apiVersion: noetl.io/v1
    kind: Playbook
    metadata: {{name: wbtask}}
    workbook:
      - name: greet
        tool: python
        code: |
          def main(who):
              return {{"hi": who}}
    workflow:
      - step: start
        {call}
    """
    assert _run(sqlite_url, tmp_path, text)["results"]["start"] == {"hi": "x"}


def test_workbook_task_that_is_no_entry_suggests_the_nearest(tmp_path):
    text = """
    apiVersion: noetl.io/v1
    kind: Playbook
    metadata: {name: wbtask}
    workbook:
      - {name: greet, tool: python, code: "result = 1"}
    workflow:
      - step: start
        tool: workbook
        task: gret
    """
    with pytest.raises(PlaybookError, match=r"pb.yaml:10: workflow\[0\]\(start\).task: no workbook entry named 'gret'"):
        compile_source(str(_write(tmp_path, text)))


STEP_NAMES = """
apiVersion: noetl.io/v2
kind: Playbook
metadata: {name: se}
workload: {ok: true}
workflow:
  - step: start
    tool: {kind: python, input: {ok: "{{ ok }}"}, code: "result = {'ok': ok}"}
    next: {spec: {mode: exclusive}, arcs: [{step: success, when: "{{ start.ok }}"}, {step: error}]}
  - step: success
    tool: {kind: python, code: "result = 'yes'"}
    next: {arcs: [{step: report}]}
  - step: error
    tool: {kind: python, code: "result = 'no'"}
    next: {arcs: [{step: report}]}
  - step: report
    tool: {kind: python, input: {s: "{{ success if success else error }}"}, code: "result = s"}
"""


@pytest.mark.parametrize(("ok", "taken"), [(True, "yes"), (False, "no")])
def test_steps_named_success_and_error(sqlite_url, tmp_path, ok, taken):
    status = _run(sqlite_url, tmp_path, STEP_NAMES, sets={"ok": ok})
    assert status["results"]["report"] == taken


def test_other_built_in_names_are_still_refused_as_step_names(tmp_path):
    text = STEP_NAMES.replace("step: error", "step: workload")
    with pytest.raises(PlaybookError, match="step name 'workload' is a built-in template name"):
        compile_source(str(_write(tmp_path, text)))


def test_a_loop_result_reads_as_iterator_completed_data(sqlite_url, tmp_path):
    text = """
    apiVersion: noetl.io/v2
    kind: Playbook
    metadata: {name: loopdata}
    workflow:
      - step: start
        loop: {in: [1, 2], iterator: x}
        tool: {kind: python, input: {x: "{{ x }}"}, code: "result = x * 10"}
        next: {arcs: [{step: end}]}
      - step: end
        tool:
          kind: python
          input:
            seed: "{{ start.data.results }}"
            stats: "{{ start.data.stats.total }}"
            alias: "{{ start.data }}"
            plain: "{{ start.results }}"
            first: "{{ start.data[0] }}"
          code: "result = [seed, stats, alias, plain, first]"
    """
    status = _run(sqlite_url, tmp_path, text)
    assert status["results"]["end"] == [[10, 20], 2, [10, 20], [10, 20], 10]


# --- --set over root ctx, workload templates, execution_id as a string -----------------------------

CTX_SET = """
apiVersion: noetl.io/v2
kind: Playbook
metadata: {name: ctxset}
workload: {region: eu}
ctx: {mode: dev, limits: {a: 1, b: 2}}
workflow:
  - step: start
    tool:
      kind: python
      input: {m: "{{ ctx.mode }}", bare: "{{ mode }}", l: "{{ ctx.limits }}", r: "{{ region }}"}
      code: "result = [m, bare, l, r]"
"""


@pytest.mark.parametrize(
    ("sets", "expected"),
    [
        ({}, ["dev", "dev", {"a": 1, "b": 2}, "eu"]),
        ({"mode": "prod"}, ["prod", "prod", {"a": 1, "b": 2}, "eu"]),
        ({"ctx.mode": "qa", "limits.b": 5}, ["qa", "qa", {"a": 1, "b": 5}, "eu"]),
        ({"region": "us"}, ["dev", "dev", {"a": 1, "b": 2}, "us"]),
    ],
)
def test_set_overrides_root_ctx_values(sqlite_url, tmp_path, sets, expected):
    status = _run(sqlite_url, tmp_path, CTX_SET, sets=sets)
    assert status["results"]["start"] == expected


WORKLOAD_TEMPLATES = """
apiVersion: noetl.io/v2
kind: Playbook
metadata: {name: wltmpl}
workload:
  payload: {user_id: 42}
  user_id: "{{ payload.user_id }}"
  greeting: "hi {{ workload.payload.user_id }} in {{ ctx.env }}"
  later: "{{ execution_id }}"
ctx: {env: test}
workflow:
  - step: start
    tool:
      kind: python
      input: {u: "{{ user_id }}", w: "{{ workload.user_id }}", g: "{{ greeting }}", l: "{{ later }}"}
      code: "result = [u, w, g, l]"
"""


def test_workload_values_that_are_templates_are_rendered(sqlite_url, tmp_path):
    status = _run(sqlite_url, tmp_path, WORKLOAD_TEMPLATES)
    assert status["results"]["start"] == [42, 42, "hi 42 in test", "{{ execution_id }}"]
    status = _run(sqlite_url, tmp_path, WORKLOAD_TEMPLATES, sets={"payload": {"user_id": 7}})
    assert status["results"]["start"][:2] == [7, 7]


def test_execution_id_is_a_string(sqlite_url, tmp_path):
    text = """
    apiVersion: noetl.io/v2
    kind: Playbook
    metadata: {name: execid}
    workflow:
      - step: start
        tool:
          kind: python
          input: {e: "{{ execution_id }}", n: "{{ execution_id | int }}"}
          code: |
            def main(e, n):
                return {"head": e[:8], "type": type(e).__name__, "n": n}
    """
    status = _run(sqlite_url, tmp_path, text)
    execution_id = status["execution_id"]
    assert status["results"]["start"] == {"head": str(execution_id)[:8], "type": "str", "n": execution_id}


# --- clear refusals: noetl.worker.vars_cache, secret-manager auth providers ----------------------

VARS_CACHE = """
apiVersion: noetl.io/v1
kind: Playbook
metadata: {name: vc}
workflow:
  - step: start
    tool: python
    code: |
      def main():
          from noetl.worker.vars_cache import VarsCache
          return 1
"""


def test_vars_cache_validates_and_is_refused_by_name_at_run_time(sqlite_url, tmp_path):
    path = _write(tmp_path, VARS_CACHE)
    compile_source(str(path))  # it validates, as the corpus' vars_block.yaml must
    code, status = run_playbook(sqlite_url, path)
    assert (code, status["status"]) == (1, "failed")
    message = status["error"]["message"]
    assert "noetl.worker.vars_cache (NoETL's internal variable cache) is not available in this engine" in message
    assert "{{ vars.x }}" in message and "ModuleNotFoundError" not in message


SECRET_MANAGER = """
apiVersion: noetl.io/v2
kind: Playbook
metadata: {name: sm}
workload: {provider: secret_manager}
workflow:
  - step: start
    tool:
      kind: http
      url: http://127.0.0.1:9/x
      auth: {api: {provider: secret_manager, key: projects/p/secrets/s}}
"""


def test_a_secret_manager_auth_provider_is_refused_at_validate(tmp_path):
    with pytest.raises(PlaybookError) as raised:
        compile_source(str(_write(tmp_path, SECRET_MANAGER)))
    (problem,) = raised.value.problems
    assert (problem.line, problem.path) == (8, "workflow[0](start).tool.auth")
    assert "auth alias 'api': provider 'secret_manager' is a cloud secret manager" in problem.message


def test_a_templated_secret_manager_auth_provider_is_refused_at_run_time(sqlite_url, tmp_path):
    text = SECRET_MANAGER.replace("provider: secret_manager, key", "provider: '{{ provider }}', key")
    code, status = run_playbook(sqlite_url, _write(tmp_path, text))
    assert (code, status["status"], status["error"]["kind"]) == (1, "failed", "credential")
    assert (
        "provider 'secret_manager' is a cloud secret manager, which this engine cannot read"
        in (status["error"]["message"])
    )


# --- postgres: command_N per statement, sink data, task-level output (a real PostgreSQL) -------------


@pytest.fixture
def pg_local(fresh_postgres) -> dict[str, str]:
    """`auth: pg_local` naming a database of this test's own."""
    return {"NOETL_AUTH_PG_LOCAL": fresh_postgres.dsn}


M13_PG_MULTI = """
apiVersion: noetl.io/v2
kind: Playbook
metadata: {name: m13}
workflow:
  - step: start
    tool:
      kind: postgres
      auth: pg_local
      command: |
        CREATE TABLE items AS SELECT g AS id FROM generate_series(1, 120) AS g;
        SELECT count(*) AS n FROM items;
        SELECT 2 AS second
    next: {arcs: [{step: end}]}
  - step: end
    tool:
      kind: python
      input: {r: "{{ start }}", n: "{{ start.command_1.rows[0].n }}"}
      code: "result = {'keys': sorted(k for k in r if k.startswith('command_')), 'n': n, 'last': r['rows']}"
"""


def test_postgres_multi_statement_results_are_numbered_per_statement(sqlite_url, tmp_path, pg_local):
    status = _run(sqlite_url, tmp_path, M13_PG_MULTI, env=pg_local)
    assert status["results"]["end"] == {
        "keys": ["command_0", "command_1", "command_2"],
        "n": 120,
        "last": [{"second": 2}],
    }
    start = status["results"]["start"]
    assert start["command_0"]["row_count"] == 120 and start["command_0"]["rows"] == []
    assert start["command_0"]["affected_rows"] == 120
    # stored numbered only: the last statement's rows are not repeated at the top (templates and
    # the python task above read them there all the same)
    assert start["command_2"] == {
        "rows": [{"second": 2}],
        "row_count": 1,
        "columns": ["second"],
        "statusmessage": "SELECT 1",
    }
    assert "rows" not in start and start["statement_count"] == 3


M12_SINK_DATA = """
apiVersion: noetl.io/v1
kind: Playbook
metadata: {name: m12}
workflow:
  - step: start
    tool: python
    code: |
      def main():
          return {"payload": {"a": 1}}
    sink:
      tool: postgres
      auth: pg_local
      args: {id: 7, a: "{{ result.payload.a }}", whole: "{{ data }}"}
      statement: "CREATE TABLE sunk AS SELECT {{ data.id }} AS id, {{ data.a }} AS a, {{ data.whole.payload.a }} AS w"
  - step: check
    tool: postgres
    auth: pg_local
    command: "SELECT * FROM sunk"
"""


def test_sink_data_is_the_sinks_rendered_args(sqlite_url, tmp_path, pg_local):
    text = M12_SINK_DATA.replace("  - step: check", "    next: check\n  - step: check")
    status = _run(sqlite_url, tmp_path, text, env=pg_local)
    assert status["results"]["start"] == {"payload": {"a": 1}}
    # args render with `data` the task's data; the sink's other fields read the rendered args as `data`
    assert status["results"]["check"]["rows"] == [{"id": 7, "a": 1, "w": 1}]


def test_a_sink_without_args_still_reads_the_result_as_data(sqlite_url, tmp_path, pg_local):
    text = (
        M12_SINK_DATA.replace('      args: {id: 7, a: "{{ result.payload.a }}", whole: "{{ data }}"}\n', "")
        .replace(
            "{{ data.id }} AS id, {{ data.a }} AS a, {{ data.whole.payload.a }} AS w",
            "1 AS id, {{ data.payload.a }} AS a",
        )
        .replace("  - step: check", "    next: check\n  - step: check")
    )
    status = _run(sqlite_url, tmp_path, text, env=pg_local)
    assert status["results"]["check"]["rows"] == [{"id": 1, "a": 1}]


def test_task_level_output_on_postgres_keeps_the_whole_result(sqlite_url, tmp_path, pg_local):
    status = _run(sqlite_url, tmp_path, M15_TASK_OUTPUT, env=pg_local)
    assert status["results"]["start"]["rows"] == [{"one": 1}]
    assert status["results"]["start"]["statement_count"] == 1 and "command_0" not in status["results"]["start"]


# --- validate: a {{ name }} the playbook never gives, with its line and the nearest name ------------

TYPO = """
apiVersion: noetl.io/v2
kind: Playbook
metadata: {name: typo}
workload: {limit: 3}
workflow:
  - step: process
    tool: {kind: python, code: "result = {'n': 1}"}
    next: {arcs: [{step: report}]}
  - step: report
    tool:
      kind: python
      input: {n: "{{ proces.n }}", l: "{{ limt }}", ok: "{{ process.n + limit }}"}
      code: "result = n"
"""

TYPO_WARNINGS = [
    "pb.yaml:13: workflow[1](report).tool.input.l: warning: 'limt' in '{{ limt }}' is no step, task, workload, "
    "ctx, vars or built-in name of this playbook; did you mean 'limit'?",
    "pb.yaml:13: workflow[1](report).tool.input.n: warning: 'proces' in '{{ proces.n }}' is no step, task, "
    "workload, ctx, vars or built-in name of this playbook; did you mean 'process'?",
]


def test_validate_reports_a_name_that_is_nowhere_with_its_line_and_the_nearest(tmp_path, monkeypatch):
    from click.testing import CliRunner

    from noetl_celery.cli import cli

    monkeypatch.setenv("NOETL_HOME", str(tmp_path / "home"))
    monkeypatch.delenv("NOETL_STRICT_TEMPLATES", raising=False)
    path = _write(tmp_path, TYPO)

    def validate(*args: str) -> tuple[int, list[str]]:
        result = CliRunner().invoke(cli, ["validate", *args])
        return result.exit_code, sorted(line.replace(str(tmp_path) + "/", "") for line in result.stderr.splitlines())

    assert validate(str(path)) == (0, TYPO_WARNINGS)
    assert validate("--strict", str(path)) == (2, [line.replace(": warning: ", ": ") for line in TYPO_WARNINGS])
    assert validate("--strict", "--set", "limt=1", str(path)) == (2, [TYPO_WARNINGS[1].replace(": warning: ", ": ")])
    fixed = _write(tmp_path, TYPO.replace("proces.", "process.").replace("limt", "limit"), "fixed.yaml")
    assert validate(str(fixed)) == (0, [])


def test_a_name_that_is_nowhere_is_a_problem_where_templates_render_strictly(tmp_path):
    text = TYPO.replace("metadata: {name: typo}", "metadata: {name: typo}\nexecutor: {spec: {strict_templates: true}}")
    with pytest.raises(PlaybookError) as raised:
        compile_source(str(_write(tmp_path, text)))
    assert sorted(p.message.split(" in ")[0] for p in raised.value.problems) == ["'limt'", "'proces'"]
    warnings: list[Any] = []
    compile_source(str(_write(tmp_path, TYPO, "lenient.yaml")), warnings=warnings)
    assert sorted((w.line, w.path) for w in warnings) == [
        (13, "workflow[1](report).tool.input.l"),
        (13, "workflow[1](report).tool.input.n"),
    ]


def test_names_given_anywhere_in_the_playbook_are_not_reported(tmp_path):
    text = """
    apiVersion: noetl.io/v2
    kind: Playbook
    metadata: {name: given}
    workload: {base: 1}
    ctx: {page: 1}
    keychain: [{name: api_token}]
    workbook:
      - {name: helper, tool: python, code: "result = 1"}
    workflow:
      - step: start
        loop: {in: "{{ [1, 2] }}", iterator: num}
        tool:
          - first: {kind: python, code: "result = 1", spec: {policy: {rules: [{else: {then: {do: continue, set: {iter.seen: 1}}}}]}}}
          - second:
              kind: python
              input:
                a: "{{ first + num + iter.seen + base + page + ctx.page + loop_index + later_var }}"
                b: "{% set local = 1 %}{% for x in [1] %}{{ local + x }}{% endfor %}"
                c: "{{ given_by_set + execution_id | string + job.uuid + api_token }}"
              code: "result = {{ not_rendered }}"
        set: {vars.later_var: 1}
        next: {arcs: [{step: end, args: {passed: 1}}]}
      - step: end
        tool: {kind: python, input: {p: "{{ passed }}", s: "{{ start }}"}, code: "result = p"}
    """
    warnings: list[Any] = []
    compile_source(str(_write(tmp_path, text)), {"given_by_set": 1}, warnings=warnings)
    assert warnings == []
    compile_source(str(tmp_path / "pb.yaml"), {}, warnings=warnings)
    assert [w.message.split(" in ")[0] for w in warnings] == ["'given_by_set'"]


# --- task-level set: (m15) ---------------------------------------------------------------------------

TASK_SET = """
apiVersion: noetl.io/v2
kind: Playbook
metadata: {name: taskset}
workflow:
  - step: start
    tool:
      - first:
          kind: python
          code: "result = {'n': 2}"
          set: {ctx.n: "{{ output.data.n }}", seen: true, vars.v: "{{ output.data.n * 10 }}"}
          output_select: [n]
      - second: {kind: python, input: {n: "{{ ctx.n }}"}, code: "result = n"}
    next: {arcs: [{step: end}]}
  - step: end
    tool: {kind: python, input: {n: "{{ ctx.n }}", v: "{{ vars.v }}"}, code: "result = [n, v]"}
"""


def test_task_level_set_writes_when_the_task_succeeds(sqlite_url, tmp_path):
    status = _run(sqlite_url, tmp_path, TASK_SET)
    assert (status["results"]["start"], status["results"]["end"]) == (2, [2, 20])
    assert status["ctx"] == {"n": 2, "seen": True} and status["vars"] == {"v": 20}


def test_task_level_set_joins_the_tasks_own_policy(sqlite_url, tmp_path):
    text = TASK_SET.replace(
        "          output_select: [n]",
        "          spec: {policy: {rules: [{when: '{{ output.data.n > 1 }}', then: {do: continue, set: {ctx.n: 5}}}]}}",
    )
    status = _run(sqlite_url, tmp_path, text)
    assert status["ctx"] == {"n": 5, "seen": True}  # the rule's own assignment wins, the task's others join it
    failing = TASK_SET.replace("result = {'n': 2}", "raise ValueError('no')")
    code, status = run_playbook(sqlite_url, _write(tmp_path, failing))
    assert (code, status["status"], status["ctx"]) == (1, "failed", {})


def test_validate_suggests_the_nearest_registered_sub_playbook(tmp_path, monkeypatch):
    from click.testing import CliRunner

    from noetl_celery.cli import cli

    monkeypatch.setenv("NOETL_HOME", str(tmp_path / "home"))
    child = _write(tmp_path / "elsewhere", CHILD.replace("tests/fidelity/child", "shared/reports/monthly"), "c.yaml")
    assert CliRunner().invoke(cli, ["register", str(child)]).exit_code == 0
    parent = _write(tmp_path, M08_PLAYBOOK_PAYLOAD.replace('"{{ child }}"', "shared/reports/montly"))
    result = CliRunner().invoke(cli, ["validate", str(parent)])
    assert result.exit_code == 2
    assert result.stderr.strip().endswith(
        "(more directories: NOETL_PLAYBOOK_PATH); did you mean 'shared/reports/monthly'?"
    )
