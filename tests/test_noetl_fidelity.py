"""NoETL fidelity: behaviours of real NoETL playbooks, each from a minimal playbook that shows it,
run in-process on the harness (tests/support/harness.py) on SQLite.

Lenient rendering (args, sinks, set/vars, arcs render as NoETL renders them, a hidden undefined
name is noted in the row's meta `template_warnings`; NOETL_STRICT_TEMPLATES=1 or
`executor.spec.strict_templates: true` asks for strict rendering), pipeline task results by
label and `output` inside a pipeline."""

from __future__ import annotations

import textwrap
from pathlib import Path
from typing import Any

import pytest

from noetl_celery import runner
from noetl_celery.templates.render import HIDDEN_META
from tests.support.harness import run_playbook

M02_NOTRUN = """
apiVersion: noetl.io/v2
kind: Playbook
metadata: {name: m02}
workflow:
  - step: start
    tool: {kind: python, code: "result = {'n': 1}"}
    next: {spec: {mode: exclusive}, arcs: [{step: low, when: "{{ start.n < 5 }}"}, {step: high}]}
  - step: high
    tool: {kind: python, code: "result = {'c': 'high'}"}
    next: {arcs: [{step: summary}]}
  - step: low
    tool: {kind: python, code: "result = {'c': 'low'}"}
    next: {arcs: [{step: summary}]}
  - step: summary
    tool: {kind: python, input: {c: "{{ high.c if high else low.c }}"}, code: "result = {'c': c}"}
"""

M16_ARC_WHEN_ERROR = """
apiVersion: noetl.io/v2
kind: Playbook
metadata: {name: x01}
workflow:
  - step: start
    tool: {kind: python, code: "result = {'a': 1}"}
    next:
      spec: {mode: exclusive}
      arcs:
        - step: high
          when: "{{ start.missing_key > 5 }}"
        - step: low
  - step: high
    tool: {kind: python, code: "result = 'high'"}
  - step: low
    tool: {kind: python, code: "result = 'low'"}
"""

M01_LABEL = """
apiVersion: noetl.io/v2
kind: Playbook
metadata: {name: m01}
workflow:
  - step: start
    tool:
      - name: build
        kind: python
        code: "result = {'id': 7}"
      - name: use
        kind: python
        input: {id: "{{ build.id }}"}
        code: "result = {'got': id}"
"""

M03_PREV_OUTPUT = """
apiVersion: noetl.io/v2
kind: Playbook
metadata: {name: m03}
workflow:
  - step: start
    tool:
      - name: first
        kind: python
        code: "result = {'v': 1}"
      - name: second
        kind: python
        input: {d: "{{ output.data }}"}
        code: "result = d"
"""

STRICT_ENV = {"NOETL_STRICT_TEMPLATES": "1"}


def _write(tmp_path: Path, text: str, name: str = "pb.yaml") -> Path:
    path = tmp_path / name
    path.write_text(textwrap.dedent(text))
    return path


def _warnings(url: str, execution_id: int) -> list[tuple[str, str | None, str]]:
    """(event type, step, note) of every note a lenient render left in the execution's rows."""
    found = []
    for row in runner.execution_events(url, execution_id):
        meta: dict[str, Any] = row.get("meta") or {}
        for note in meta.get(HIDDEN_META) or []:
            found.append((row["event_type"], row.get("step"), note))
    return found


# --- lenient templates ---------------------------------------------------------------------------


def test_a_step_that_did_not_run_reads_as_false_in_args(sqlite_url, tmp_path):
    code, status = run_playbook(sqlite_url, _write(tmp_path, M02_NOTRUN))
    assert (code, status["status"]) == (0, "completed"), status["error"]
    assert status["results"]["summary"] == {"c": "low"}
    assert "high" not in status["results"]
    notes = _warnings(sqlite_url, status["execution_id"])
    assert [(t, s) for t, s, _ in notes] == [("action.completed", "summary")]
    assert "'high' is undefined" in notes[0][2] and "high.c if high else low.c" in notes[0][2]


@pytest.mark.parametrize("how", ["deployment", "playbook"])
def test_strict_rendering_fails_the_step_on_an_undefined_name(sqlite_url, tmp_path, how):
    text = M02_NOTRUN
    env: dict[str, str] = {}
    if how == "deployment":
        env = STRICT_ENV
    else:
        text = text.replace(
            "metadata: {name: m02}", "metadata: {name: m02}\nexecutor: {spec: {strict_templates: true}}"
        )
    code, status = run_playbook(sqlite_url, _write(tmp_path, text), env=env)
    assert (code, status["status"]) == (1, "failed")
    assert status["error"]["kind"] == "template"
    assert "'high' is undefined" in status["error"]["message"]


def test_strict_templates_must_be_a_boolean(tmp_path):
    from noetl_celery.compiler import compile_source
    from noetl_celery.core.errors import PlaybookError

    text = M02_NOTRUN.replace("metadata: {name: m02}", "metadata: {name: m02}\nexecutor: {spec: {strict_templates: 2}}")
    with pytest.raises(PlaybookError, match="strict_templates: must be true or false"):
        compile_source(str(_write(tmp_path, text)), {})


def test_an_arc_when_that_raises_is_false_and_noted(sqlite_url, tmp_path):
    code, status = run_playbook(sqlite_url, _write(tmp_path, M16_ARC_WHEN_ERROR))
    assert (code, status["status"]) == (0, "completed"), status["error"]
    assert status["results"] == {"start": {"a": 1}, "low": "low"}
    notes = _warnings(sqlite_url, status["execution_id"])
    assert [(t, s) for t, s, _ in notes] == [("step.completed", "start")]
    assert "arc to 'high'" in notes[0][2] and "missing_key" in notes[0][2]


def test_an_arc_when_that_raises_fails_the_step_when_strict(sqlite_url, tmp_path):
    code, status = run_playbook(sqlite_url, _write(tmp_path, M16_ARC_WHEN_ERROR), env=STRICT_ENV)
    assert (code, status["status"]) == (1, "failed")
    assert status["failed_step"] == "start" and "missing_key" in status["error"]["message"]


@pytest.mark.parametrize("bomb", ["(9 ** (9 ** 9)) > 1", "('x' * (10 ** 10)) | length > 1"])
def test_an_arc_when_past_its_template_budget_fails_the_step_also_when_lenient(sqlite_url, tmp_path, bomb):
    text = M16_ARC_WHEN_ERROR.replace("{{ start.missing_key > 5 }}", "{{ " + bomb + " }}")
    code, status = run_playbook(sqlite_url, _write(tmp_path, text))
    assert (code, status["status"]) == (1, "failed"), status
    assert status["failed_step"] == "start" and "more than the template limit of" in status["error"]["message"]


def test_a_typo_in_set_is_null_and_findable(sqlite_url, tmp_path):
    text = """
    apiVersion: noetl.io/v2
    kind: Playbook
    metadata: {name: typo}
    workflow:
      - step: start
        tool: {kind: python, code: "result = {'n': 3}"}
        set: {good: "{{ start.n }}", typo: "{{ strat.n }}"}
        next: {arcs: [{step: end}]}
      - step: end
        tool: {kind: python, input: {g: "{{ ctx.good }}", t: "{{ ctx.typo }}"}, code: "result = [g, t]"}
    """
    code, status = run_playbook(sqlite_url, _write(tmp_path, text))
    assert (code, status["status"]) == (0, "completed"), status["error"]
    assert status["results"]["end"] == [3, None]
    notes = _warnings(sqlite_url, status["execution_id"])
    assert [(t, s) for t, s, _ in notes] == [("step.completed", "start")]
    assert "'strat' is undefined" in notes[0][2]


def test_lenient_text_renders_an_undefined_name_as_empty(sqlite_url, tmp_path):
    text = """
    apiVersion: noetl.io/v2
    kind: Playbook
    metadata: {name: text}
    workflow:
      - step: start
        tool: {kind: python, input: {s: "id={{ nothing.here }};"}, code: "result = s"}
    """
    code, status = run_playbook(sqlite_url, _write(tmp_path, text))
    assert (code, status["status"]) == (0, "completed"), status["error"]
    assert status["results"]["start"] == "id=;"
    assert len(_warnings(sqlite_url, status["execution_id"])) == 1


def test_comparing_an_undefined_name_still_fails_a_task(sqlite_url, tmp_path):
    """Only a use that NoETL's renderer tolerates is lenient: arithmetic on nothing still fails."""
    text = """
    apiVersion: noetl.io/v2
    kind: Playbook
    metadata: {name: arith}
    workflow:
      - step: start
        tool: {kind: python, input: {s: "{{ nothing + 1 }}"}, code: "result = s"}
    """
    code, status = run_playbook(sqlite_url, _write(tmp_path, text))
    assert (code, status["status"]) == (1, "failed")
    assert "'nothing' is undefined" in status["error"]["message"]


# --- pipeline task results by label, `output` ------------------------------------------------


def test_pipeline_task_result_by_bare_label(sqlite_url, tmp_path):
    code, status = run_playbook(sqlite_url, _write(tmp_path, M01_LABEL))
    assert (code, status["status"]) == (0, "completed"), status["error"]
    assert status["results"]["start"] == {"got": 7}
    assert _warnings(sqlite_url, status["execution_id"]) == []


def test_pipeline_output_is_the_previous_task_outcome(sqlite_url, tmp_path):
    code, status = run_playbook(sqlite_url, _write(tmp_path, M03_PREV_OUTPUT))
    assert (code, status["status"]) == (0, "completed"), status["error"]
    assert status["results"]["start"] == {"v": 1}


def test_pipeline_labels_strict_as_well(sqlite_url, tmp_path):
    """Labels and `output` are real names, not lenient fallbacks."""
    for text, expected in ((M01_LABEL, {"got": 7}), (M03_PREV_OUTPUT, {"v": 1})):
        code, status = run_playbook(sqlite_url, _write(tmp_path, text), env=STRICT_ENV)
        assert (code, status["status"], status["results"]["start"]) == (0, "completed", expected)


# --- next.arcs[].set, policy set with bare keys ---------------------------------------------

M04_ARCSET = """
apiVersion: noetl.io/v2
kind: Playbook
metadata: {name: m04}
workflow:
  - step: start
    tool: {kind: python, code: "result = {'ok': True}"}
    next:
      arcs:
        - step: end
          set: {ctx.from_start: "{{ start.ok }}", bare: 5, vars.v: "{{ output.data.ok }}"}
        - step: never
          when: "{{ false }}"
          set: {ctx.never: 1}
  - step: end
    tool: {kind: python, input: {v: "{{ ctx.from_start }}"}, code: "result = v"}
  - step: never
    tool: {kind: python, code: "result = 0"}
"""

M14_POLICY_SET_BARE = """
apiVersion: noetl.io/v2
kind: Playbook
metadata: {name: m14}
workflow:
  - step: start
    tool:
      kind: python
      code: "result = {'n': 1}"
      spec: {policy: {rules: [{else: {then: {do: continue, set: {seen: "{{ output.data.n }}"}}}}]}}
"""


def test_arc_set_writes_ctx_when_the_arc_is_taken(sqlite_url, tmp_path):
    code, status = run_playbook(sqlite_url, _write(tmp_path, M04_ARCSET))
    assert (code, status["status"]) == (0, "completed"), status["error"]
    assert status["results"]["end"] is True
    assert status["ctx"] == {"from_start": True, "bare": 5}  # not `never`: its arc was not taken
    assert status["vars"] == {"v": True}


def test_arc_set_keys_are_checked(tmp_path):
    from noetl_celery.compiler import compile_source
    from noetl_celery.core.errors import PlaybookError

    text = M04_ARCSET.replace("ctx.never: 1", "iter.never: 1")
    with pytest.raises(PlaybookError, match=r"arcs\[1\]\.set\.iter\.never: set keys look like ctx.x or vars.x"):
        compile_source(str(_write(tmp_path, text)), {})


def test_policy_set_bare_key_is_a_ctx_variable(sqlite_url, tmp_path):
    code, status = run_playbook(sqlite_url, _write(tmp_path, M14_POLICY_SET_BARE))
    assert (code, status["status"]) == (0, "completed"), status["error"]
    assert status["ctx"] == {"seen": 1}


# --- templated max_in_flight ------------------------------------------------------------------

M05_MAXINFLIGHT = """
apiVersion: noetl.io/v2
kind: Playbook
metadata: {name: m05}
workload: {n: 2}
workflow:
  - step: start
    loop: {in: [1, 2, 3], iterator: x, spec: {mode: parallel, max_in_flight: "{{ n }}"}}
    tool: {kind: python, input: {x: "{{ x }}"}, code: "result = x"}
"""


def test_templated_max_in_flight_runs_and_follows_the_workload(sqlite_url, tmp_path):
    from noetl_celery.compiler import compile_source

    path = _write(tmp_path, M05_MAXINFLIGHT)
    code, status = run_playbook(sqlite_url, path)
    assert (code, status["status"]) == (0, "completed"), status["error"]
    assert status["results"]["start"]["results"] == [1, 2, 3]
    assert compile_source(str(path), {}).steps["start"].loop.max_in_flight == 2
    assert compile_source(str(path), {"n": 5}).steps["start"].loop.max_in_flight == 5  # --set n=5
    ctx_form = M05_MAXINFLIGHT.replace("workload: {n: 2}", "ctx: {cap: '3'}").replace("{{ n }}", "{{ ctx.cap }}")
    assert compile_source(str(_write(tmp_path, ctx_form, "ctx.yaml")), {}).steps["start"].loop.max_in_flight == 3


@pytest.mark.parametrize(
    ("template", "said"),
    [("{{ nope }}", "'nope' is undefined"), ("{{ n / 4 }}", "rendered to 0.5"), ("{{ -n }}", "rendered to -2")],
)
def test_templated_max_in_flight_that_is_no_count_is_a_problem(tmp_path, template, said):
    from noetl_celery.compiler import compile_source
    from noetl_celery.core.errors import PlaybookError

    text = M05_MAXINFLIGHT.replace("{{ n }}", template)
    with pytest.raises(PlaybookError) as caught:
        compile_source(str(_write(tmp_path, text)), {})
    message = str(caught.value)
    assert "pb.yaml:8: workflow[0](start).loop.spec.max_in_flight: max_in_flight" in message and said in message


# --- case: with a structural next: fallback ---------------------------------------------------

M09_CASE_NEXT = """
apiVersion: noetl.io/v2
kind: Playbook
metadata: {name: m09}
workload: {limit: 5}
workflow:
  - step: start
    tool: {kind: python, code: "result = {'n': 1}"}
    case:
      - when: "{{ event.name == 'call.done' and result.n > limit }}"
        then: {next: [{step: big}]}
    next: end
  - step: big
    tool: {kind: python, code: "result = 'big'"}
  - step: end
    tool: {kind: python, code: "result = 'end'"}
"""


@pytest.mark.parametrize(("limit", "taken"), [(5, "end"), (0, "big")])
def test_case_with_next_falls_back_to_next_when_no_case_routes(sqlite_url, tmp_path, limit, taken):
    code, status = run_playbook(sqlite_url, _write(tmp_path, M09_CASE_NEXT), sets={"limit": limit})
    assert (code, status["status"]) == (0, "completed"), status["error"]
    assert set(status["results"]) == {"start", taken}


# --- output_select as a list, task-level result hints ------------------------------------------

M07_OUTPUTSELECT = """
apiVersion: noetl.io/v2
kind: Playbook
metadata: {name: m07}
workflow:
  - step: start
    tool: {kind: python, code: "result = {'status': 'ok', 'count': 2, 'items': [1, 2]}"}
    result:
      output_select: [status, count]
"""

M15_TASK_OUTPUT = """
apiVersion: noetl.io/v2
kind: Playbook
metadata: {name: m15}
workflow:
  - step: start
    tool:
      kind: postgres
      auth: pg_local
      command: "SELECT 1 AS one"
      output: {select: [{path: "$.rows", as: rows}]}
"""


def test_output_select_list_never_trims_a_result(sqlite_url, tmp_path):
    from noetl_celery.compiler import compile_source

    path = _write(tmp_path, M07_OUTPUTSELECT)
    step = compile_source(str(path), {}).steps["start"]
    assert (step.result_select, step.result_hints) == (None, {"result.output_select": ["status", "count"]})
    code, status = run_playbook(sqlite_url, path)
    assert (code, status["status"]) == (0, "completed"), status["error"]
    assert status["results"]["start"] == {"status": "ok", "count": 2, "items": [1, 2]}


def test_task_level_output_hints_are_read_not_passed_to_the_tool(sqlite_url, tmp_path):
    from noetl_celery.compiler import compile_source

    task = compile_source(str(_write(tmp_path, M15_TASK_OUTPUT)), {}).steps["start"].tasks[0]
    assert task.config == {"command": "SELECT 1 AS one"}
    assert task.hints == {"output": {"select": [{"path": "$.rows", "as": "rows"}]}}
    python_form = """
    apiVersion: noetl.io/v2
    kind: Playbook
    metadata: {name: m15py}
    workflow:
      - step: start
        tool:
          - first:
              kind: python
              code: "result = {'rows': [1, 2], 'n': 2}"
              output_select: [rows]
              spec: {output: {select: [{path: "$.rows", as: rows}]}}
          - second: {kind: python, input: {r: "{{ first.rows }}"}, code: "result = r"}
    """
    code, status = run_playbook(sqlite_url, _write(tmp_path, python_form, "py.yaml"))
    assert (code, status["status"]) == (0, "completed"), status["error"]
    assert status["results"]["start"] == [1, 2]


def test_a_routing_only_task_notes_what_it_hid_on_its_step(sqlite_url, tmp_path):
    text = """
    apiVersion: noetl.io/v2
    kind: Playbook
    metadata: {name: noop_hidden}
    workflow:
      - step: start
        tool: {kind: noop, args: {v: "{{ missing_step.value }}"}}
    """
    code, status = run_playbook(sqlite_url, _write(tmp_path, text))
    assert (code, status["status"]) == (0, "completed"), status["error"]
    assert status["results"]["start"] == {"v": None}
    notes = _warnings(sqlite_url, status["execution_id"])
    assert [(t, s) for t, s, _ in notes] == [("step.completed", "start")]
    assert "'missing_step' is undefined" in notes[0][2]


def test_a_policy_set_notes_what_it_hid_on_the_attempt(sqlite_url, tmp_path):
    text = M14_POLICY_SET_BARE.replace("{{ output.data.n }}", "{{ outptu.data.n }}")
    code, status = run_playbook(sqlite_url, _write(tmp_path, text))
    assert (code, status["status"]) == (0, "completed"), status["error"]
    assert status["ctx"] == {"seen": None}
    notes = _warnings(sqlite_url, status["execution_id"])
    assert [(t, s) for t, s, _ in notes] == [("action.completed", "start")]
    assert "'outptu' is undefined" in notes[0][2]


def test_a_sink_renders_leniently_and_notes_what_it_hid(sqlite_url, tmp_path):
    text = """
    apiVersion: noetl.io/v2
    kind: Playbook
    metadata: {name: sink_hidden}
    workflow:
      - step: start
        tool:
          kind: python
          code: "result = {'n': 2}"
          sink: {kind: event_log, args: {n: "{{ result.n }}", typo: "{{ reslt.n }}"}}
    """
    code, status = run_playbook(sqlite_url, _write(tmp_path, text))
    assert (code, status["status"]) == (0, "completed"), status["error"]
    rows = runner.execution_events(sqlite_url, status["execution_id"])
    (attempt,) = [r for r in rows if r["event_type"] == "action.completed"]
    assert attempt["meta"]["sink"]["status"] == "ok"
    (note,) = attempt["meta"]["sink"][HIDDEN_META]
    assert "'reslt' is undefined" in note
    (logged,) = [r for r in rows if r["event_type"] == "sink.event_log"]
    assert logged["result"] == {"n": 2, "typo": None}
    # strict rendering: the typo is a name the playbook never gives, refused before it runs
    from noetl_celery.core.errors import PlaybookError

    with pytest.raises(PlaybookError, match=r"pb.yaml:10: .*'reslt' in .* did you mean 'result'\?"):
        run_playbook(sqlite_url, _write(tmp_path, text), env=STRICT_ENV)
    text = text.replace("{{ reslt.n }}", "{{ result.missing.n }}")  # a missing key still fails the sink
    code, status = run_playbook(sqlite_url, _write(tmp_path, text), env=STRICT_ENV)
    assert (code, status["status"], status["error"]["kind"]) == (1, "failed", "sink")
