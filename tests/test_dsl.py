"""Unit tests of the playbook front end: one behaviour per test, on small inline playbooks."""

from __future__ import annotations

import json
import textwrap

import pytest

from noetl_celery.core.errors import PlaybookError, Problem
from noetl_celery.dsl import load_plan
from noetl_celery.dsl.plan import (
    DEFAULT_MAX_DELAY,
    DEFAULT_MAX_IN_FLIGHT,
    DEFAULT_PAGINATION_MAX,
    Action,
    Collect,
    Plan,
    Rule,
)

FILE = "pb.yaml"
V1 = "apiVersion: noetl.io/v1\nkind: Playbook\nmetadata:\n  name: t\n"
V10 = "apiVersion: noetl.io/v10\nkind: Playbook\nmetadata:\n  name: t\n"
V2 = "apiVersion: noetl.io/v2\nkind: Playbook\nmetadata:\n  name: t\n"


def compile_text(head: str, body: str, **kwargs: object) -> Plan:
    return load_plan(FILE, text=head + textwrap.dedent(body), **kwargs)  # type: ignore[arg-type]


def problems(head: str, body: str) -> list[Problem]:
    with pytest.raises(PlaybookError) as raised:
        compile_text(head, body)
    return raised.value.problems


def texts(head: str, body: str) -> list[str]:
    return [str(p) for p in problems(head, body)]


def strict_problems(head: str, body: str) -> list[Problem]:
    """The problems `validate --strict` prints: the warnings (unknown keys, unknown names) too."""
    warnings: list[Problem] = []
    try:
        compile_text(head, body, warnings=warnings)
        found: list[Problem] = []
    except PlaybookError as exc:
        found = list(exc.problems)
    assert found or warnings, "no problem and no warning"
    return sorted(found + warnings, key=lambda p: (p.line or 0, p.path))


def strict_texts(head: str, body: str) -> list[str]:
    return [str(p) for p in strict_problems(head, body)]


def warned(head: str, body: str) -> list[str]:
    """The warnings of a playbook that validates."""
    warnings: list[Problem] = []
    compile_text(head, body, warnings=warnings)
    return [str(p) for p in warnings]


# ---------------------------------------------------------------------------------------------
# Loading


def test_broken_yaml_is_a_problem_with_the_yaml_line() -> None:
    found = problems(V1, "workflow:\n  - step: start\n    next: [a, b\n  - step: b\n")
    assert len(found) == 1
    assert found[0].line == 7 and "invalid YAML" in found[0].message  # where the '[' was opened
    assert "the '[' opened at line 7 is not closed" in found[0].message


def test_duplicate_key_is_a_problem_at_the_second_occurrence() -> None:
    found = problems(V1, "workflow:\n  - step: start\n    desc: a\n    desc: b\n")
    assert [str(p) for p in found] == [
        "pb.yaml:8: workflow[0](start).desc: duplicate key 'desc' (first given at line 7)"
    ]


def test_keys_stay_text_and_dates_stay_strings() -> None:
    plan = compile_text(V1, "workload:\n  on: 1\n  day: 2025-12-01\nworkflow:\n  - step: start\n")
    assert plan.workload == {"on": 1, "day": "2025-12-01"}
    json.dumps(plan.model_dump(mode="json"))


def test_template_syntax_error_is_a_problem_at_its_key() -> None:
    found = texts(V1, "workflow:\n  - step: start\n    tool: python\n    code: 'x'\n    args: {a: '{{ x + }}'}\n")
    assert len(found) == 1
    assert found[0].startswith("pb.yaml:9: workflow[0](start).args.a: template does not parse")


def test_python_code_is_not_parsed_as_a_template() -> None:
    plan = compile_text(V1, "workflow:\n  - step: start\n    tool: python\n    code: 'x = \"{{ {%\"'\n")
    assert plan.steps["start"].tasks[0].config["code"] == 'x = "{{ {%"'


# ---------------------------------------------------------------------------------------------
# Top level


def test_unsupported_api_version_and_kind_are_problems_together() -> None:
    head = "apiVersion: noetl.io/v3\nkind: Flow\nmetadata:\n  name: t\n"
    found = problems(head, "workflow:\n  - step: start\n")
    assert [(p.line, p.path) for p in found] == [(1, "apiVersion"), (2, "kind")]


@pytest.mark.parametrize("version", ["noetl.io/v1", "noetl.io/v2", "noetl.io/v10"])
def test_every_known_api_version_is_accepted(version: str) -> None:
    head = f"apiVersion: {version}\nkind: Playbook\nmetadata:\n  name: t\n"
    assert compile_text(head, "workflow:\n  - step: start\n").api_version == version


def test_unknown_top_level_key_suggests_the_near_one() -> None:
    found = strict_texts(V1, "workfow:\n  - step: start\n")
    assert "pb.yaml:5: workfow: unknown key 'workfow'; did you mean 'workflow'?" in found
    assert "pb.yaml:1: a playbook needs workflow: [steps]" in found


def test_workload_overrides_are_deep_merged() -> None:
    body = "workload:\n  api: {url: a, timeout: 5}\n  n: 1\nworkflow:\n  - step: start\n"
    plan = compile_text(V1, body, overrides={"api": {"url": "b"}, "extra": True})
    assert plan.workload == {"api": {"url": "b", "timeout": 5}, "n": 1, "extra": True}


def test_entry_is_executor_entry_step_then_start_then_first() -> None:
    executor = "executor:\n  spec:\n    entry_step: b\n    final_step: a\n    no_next_is_error: true\n"
    plan = compile_text(V10, executor + "workflow:\n  - step: a\n  - step: b\n")
    assert (plan.entry_step, plan.final_step, plan.no_next_is_error) == ("b", "a", True)
    assert compile_text(V10, "workflow:\n  - step: a\n  - step: start\n").entry_step == "start"
    assert compile_text(V10, "workflow:\n  - step: a\n  - step: b\n").entry_step == "a"


def test_unknown_entry_step_is_a_problem_with_suggestion() -> None:
    found = texts(V10, "executor:\n  spec:\n    entry_step: strt\nworkflow:\n  - step: start\n")
    assert found == ["pb.yaml:7: executor.spec.entry_step: no step named 'strt'; did you mean 'start'?"]


def test_ctx_and_metadata_are_kept() -> None:
    head = V10 + "  path: a/b\n  description: d\n"
    plan = compile_text(head, "ctx:\n  page: 1\nworkflow:\n  - step: start\n")
    assert (plan.ctx, plan.path, plan.description, plan.source_file) == ({"page": 1}, "a/b", "d", FILE)


# ---------------------------------------------------------------------------------------------
# Steps and arcs


def test_unknown_step_key_names_file_line_path_and_suggestion() -> None:
    found = strict_texts(V1, "workflow:\n  - step: start\n    nxt:\n      - step: start\n")
    assert found == ["pb.yaml:7: workflow[0](start).nxt: unknown key 'nxt'; did you mean 'next'?"]


def test_all_problems_are_collected_before_raising() -> None:
    body = """\
    workflow:
      - step: start
        nxt: end
      - step: fetch
        tool: http
        metod: GET
        url: x
        next:
          - step: nowhere
    """
    found = strict_texts(V1, body)
    assert found == [
        "pb.yaml:7: workflow[0](start).nxt: unknown key 'nxt'; did you mean 'next'?",
        "pb.yaml:10: workflow[1](fetch).metod: unknown key 'metod' for the http tool; did you mean 'method'?",
        "pb.yaml:13: workflow[1](fetch).next[0].step: no step named 'nowhere'",
    ]


def test_dash_step_inside_next_is_an_unknown_key() -> None:
    found = texts(V1, "workflow:\n  - step: start\n    next:\n      -step: end\n  - step: end\n")
    assert found == ["pb.yaml:8: workflow[0](start).next.-step: unknown key '-step'; did you mean 'step'?"]


def test_arc_to_a_missing_step_suggests_the_near_name() -> None:
    found = texts(V1, "workflow:\n  - step: start\n    next:\n      - step: fetch_user\n  - step: fetch_users\n")
    assert found == [
        "pb.yaml:8: workflow[0](start).next[0].step: no step named 'fetch_user'; did you mean 'fetch_users'?"
    ]


def test_duplicate_step_names_are_a_problem() -> None:
    found = texts(V1, "workflow:\n  - step: start\n  - step: start\n")
    assert found == ["pb.yaml:7: workflow[1](start).step: step 'start' is already defined at line 6"]


def test_legacy_next_entries_fire_inclusively_with_when_then_else() -> None:
    body = """\
    workflow:
      - step: start
        next:
          - step: a
            args: {x: 1}
          - when: "{{ ok }}"
            step: b
          - when: "{{ big }}"
            then: [{step: c}]
            else: [{step: d}]
      - step: a
      - step: b
      - step: c
      - step: d
    """
    routing = compile_text(V1, body).steps["start"].next
    assert routing.mode == "inclusive"
    assert [(a.step, a.when, a.negate, a.args) for a in routing.arcs] == [
        ("a", None, False, {"x": 1}),
        ("b", "{{ ok }}", False, {}),
        ("c", "{{ big }}", False, {}),
        ("d", "{{ big }}", True, {}),
    ]


def test_next_as_a_string_or_a_mapping() -> None:
    plan = compile_text(V1, "workflow:\n  - step: start\n    next: a\n  - step: a\n    next: {step: start}\n")
    assert [a.step for a in plan.steps["start"].next.arcs] == ["a"]
    assert [a.step for a in plan.steps["a"].next.arcs] == ["start"]


def test_canonical_next_defaults_to_exclusive_and_parallel_means_inclusive() -> None:
    body = """\
    workflow:
      - step: start
        next:
          arcs:
            - {step: a, when: "{{ x }}", args: {n: 1}}
      - step: a
        next:
          spec: {mode: parallel}
          arcs: [{step: start}]
    """
    plan = compile_text(V10, body)
    assert plan.steps["start"].next.mode == "exclusive"
    assert plan.steps["start"].next.arcs[0].model_dump(exclude={"line", "set_ctx", "set_vars", "fallback"}) == {
        "step": "a",
        "when": "{{ x }}",
        "negate": False,
        "args": {"n": 1},
    }
    assert plan.steps["a"].next.mode == "inclusive"


def test_unknown_routing_mode_is_a_problem() -> None:
    found = texts(V10, "workflow:\n  - step: start\n    next:\n      spec: {mode: exclusiv}\n      arcs: []\n")
    assert found == [
        ("pb.yaml:8: workflow[0](start).next.spec.mode: unknown routing mode 'exclusiv'; did you mean 'exclusive'?")
    ]


def test_on_no_match_is_kept_on_the_routing() -> None:
    body = "workflow:\n  - step: start\n    next:\n      spec: {mode: exclusive, on_no_match: quiet}\n      arcs: []\n"
    assert compile_text(V10, body).steps["start"].next.on_no_match == "quiet"


def test_vars_set_ctx_and_set_alias_stay_unrendered() -> None:
    body = """\
    workflow:
      - step: start
        vars: {a: "{{ result.a }}"}
        set_ctx: {b: 1}
        set: {ctx.c: "{{ x }}", vars.d: 2}
    """
    step = compile_text(V1, body).steps["start"]
    assert step.vars == {"a": "{{ result.a }}", "d": 2}
    assert step.set_ctx == {"b": 1, "c": "{{ x }}"}


def test_step_set_with_an_unknown_scope_is_a_problem() -> None:
    found = texts(V10, "workflow:\n  - step: start\n    set: {iter.x: 1}\n")
    assert found == ["pb.yaml:7: workflow[0](start).set.iter.x: set keys look like ctx.x or vars.x (a bare x is ctx.x)"]


# ---------------------------------------------------------------------------------------------
# Legacy tasks


def test_legacy_step_fields_become_one_task() -> None:
    body = """\
    workflow:
      - step: start
        tool: http
        auth: api_token
        method: GET
        url: "{{ workload.url }}"
        params: {page: 1}
        args: {a: 1}
    """
    task = compile_text(V1, body).steps["start"].tasks[0]
    assert (task.label, task.kind, task.auth, task.line) == ("start", "http", "api_token", 7)
    assert task.config == {
        "method": "GET",
        "url": "{{ workload.url }}",
        "params": {"page": 1},
        "args": {"a": 1},
    }


def test_routing_only_steps_have_no_task() -> None:
    body = "workflow:\n  - step: start\n    next: [{step: a}]\n  - step: a\n    tool: router\n    next: b\n  - step: b\n    tool: end\n"
    plan = compile_text(V1, body)
    assert [plan.steps[name].tasks for name in ("start", "a", "b")] == [[], [], []]


def test_a_sink_on_a_routing_only_step_gets_a_noop_task() -> None:
    body = "workflow:\n  - step: start\n    tool: end\n    sink:\n      tool: event_log\n      args: {status: ok}\n"
    tasks = compile_text(V1, body).steps["start"].tasks
    assert [(t.label, t.kind) for t in tasks] == [("start", "noop")]
    assert tasks[0].sink is not None
    assert (tasks[0].sink.kind, tasks[0].sink.config) == ("event_log", {"args": {"status": "ok"}})


def test_legacy_sink_keeps_kind_auth_and_fields() -> None:
    body = """\
    workflow:
      - step: start
        tool: python
        code: "def main(): return 1"
        sink:
          tool: postgres
          auth: pg
          table: public.t
          mode: upsert
          key: id
          args: {id: "{{ result.data.id }}"}
    """
    sink = compile_text(V1, body).steps["start"].tasks[0].sink
    assert sink is not None and (sink.kind, sink.auth, sink.line) == ("postgres", "pg", 9)
    assert sink.config == {
        "table": "public.t",
        "mode": "upsert",
        "key": "id",
        "args": {"id": "{{ result.data.id }}"},
    }


def test_unknown_sink_field_is_a_problem() -> None:
    found = texts(V1, "workflow:\n  - step: start\n    sink: {tool: postgres, tabel: t}\n")
    assert found == [
        "pb.yaml:7: workflow[0](start).sink: postgres tool needs one of: command, query, script, sql, statement, table",
        "pb.yaml:7: workflow[0](start).sink.tabel: unknown key 'tabel' for the postgres tool; did you mean 'table'?",
    ]


def test_unsupported_tool_kind_names_the_known_kinds() -> None:
    found = problems(V1, "workflow:\n  - step: start\n    tool: duckbd\n    query: select 1\n")
    assert len(found) == 1
    assert found[0].line == 7 and found[0].path == "workflow[0](start).tool"
    assert found[0].message.startswith("tool kind 'duckbd' is not supported (known: ")
    assert found[0].message.endswith("did you mean 'duckdb'?")
    assert "http" in found[0].message and "postgres" in found[0].message


def test_missing_required_field_is_a_problem() -> None:
    found = texts(V1, "workflow:\n  - step: start\n    tool: python\n    args: {a: 1}\n")
    assert found == ["pb.yaml:7: workflow[0](start).tool: python tool needs one of: code, script"]


def test_workbook_entry_resolves_with_step_args_over_entry_args() -> None:
    body = """\
    workbook:
      - name: compute
        tool: python
        code: "def main(a, b): return a"
        args: {a: 1, b: 2}
        assert: {expects: [a]}
    workflow:
      - step: start
        tool: workbook
        name: compute
        args: {b: 3}
    """
    task = compile_text(V1, body).steps["start"].tasks[0]
    assert (task.label, task.kind) == ("start", "python")
    assert task.config == {"code": "def main(a, b): return a", "args": {"a": 1, "b": 3}}


def test_canonical_workbook_call_resolves_too() -> None:
    body = """\
    workbook:
      - name: compute
        tool: {kind: python, code: "result = 1", args: {a: null}}
    workflow:
      - step: start
        tool: {kind: workbook, name: compute, args: {a: 5}}
    """
    task = compile_text(V10, body).steps["start"].tasks[0]
    assert (task.kind, task.config["args"]) == ("python", {"a": 5})


def test_unknown_workbook_name_suggests_the_near_entry() -> None:
    body = "workbook:\n  - {name: compute_flag, tool: python, code: x}\nworkflow:\n  - step: start\n    tool: workbook\n    name: compute_flg\n"
    found = texts(V1, body)
    assert found == [
        ("pb.yaml:10: workflow[0](start).name: no workbook entry named 'compute_flg'; did you mean 'compute_flag'?")
    ]


# ---------------------------------------------------------------------------------------------
# Canonical tasks


def test_canonical_tool_fields_under_spec_are_lifted_and_policy_taken() -> None:
    body = """\
    workflow:
      - step: start
        tool:
          kind: http
          spec:
            method: GET
            endpoint: "{{ api }}/data"
            policy:
              rules:
                - else: {do: continue}
    """
    task = compile_text(V10, body).steps["start"].tasks[0]
    assert task.config == {"method": "GET", "endpoint": "{{ api }}/data"}
    assert task.policy is not None
    assert task.policy.rules[0].model_dump(exclude={"source"})["then"]["do"] == "continue"


def test_pipeline_accepts_both_label_forms_in_order() -> None:
    body = """\
    workflow:
      - step: start
        tool:
          - first: {kind: python, code: "result = 1"}
          - name: second
            kind: postgres
            auth: pg
            command: select 1
    """
    tasks = compile_text(V10, body).steps["start"].tasks
    assert [(t.label, t.kind, t.auth) for t in tasks] == [
        ("first", "python", None),
        ("second", "postgres", "pg"),
    ]
    assert tasks[1].config == {"command": "select 1"}


def test_pipeline_labels_must_be_unique() -> None:
    body = "workflow:\n  - step: start\n    tool:\n      - a: {kind: noop}\n      - a: {kind: noop}\n"
    assert texts(V10, body) == ["pb.yaml:9: workflow[0](start).tool[1]: task label 'a' is already used at line 8"]


def test_step_args_merge_into_every_task_with_task_args_winning() -> None:
    body = """\
    workflow:
      - step: start
        args: {a: 1, b: 1}
        tool:
          - one: {kind: python, code: x, args: {b: 2}}
          - two: {kind: python, code: x}
    """
    tasks = compile_text(V10, body).steps["start"].tasks
    assert [t.config["args"] for t in tasks] == [{"a": 1, "b": 2}, {"a": 1, "b": 1}]


def test_tool_field_at_canonical_step_level_is_named_and_required_field_reported() -> None:
    body = "workflow:\n  - step: start\n    tool:\n      kind: postgres\n    command: select 1\n"
    assert texts(V10, body) == [
        "pb.yaml:7: workflow[0](start).tool: postgres tool needs one of: command, query, script, sql, statement, table",
        "pb.yaml:9: workflow[0](start).command: 'command' is a field of the postgres tool; put it under tool",
    ]


def test_jump_to_an_unknown_label_is_a_problem() -> None:
    body = """\
    workflow:
      - step: start
        tool:
          - fetch: {kind: noop}
          - again:
              kind: noop
              spec: {policy: {rules: [{when: true, then: {do: jump, to: fetc}}]}}
    """
    found = texts(V10, body)
    assert found == [
        (
            "pb.yaml:9: workflow[0](start).tool[1].again.spec.policy.rules[0]: "
            "jump to unknown task 'fetc'; did you mean 'fetch'?"
        )
    ]


def test_canonical_step_without_tool_is_routing_only() -> None:
    plan = compile_text(V10, "workflow:\n  - step: start\n    next: {arcs: [{step: end}]}\n  - step: end\n")
    assert plan.steps["end"].tasks == [] and plan.dialect == "canonical"


# ---------------------------------------------------------------------------------------------
# Dialects


def test_dialect_legacy_canonical_and_v2case() -> None:
    assert compile_text(V1, "workflow:\n  - step: start\n").dialect == "legacy"
    assert compile_text(V1, "workflow:\n  - step: start\n    tool: {kind: noop}\n").dialect == "canonical"
    assert compile_text(V2, "workflow:\n  - step: start\n    tool: noop\n").dialect == "canonical"
    case = (
        "workflow:\n  - step: start\n    tool: {kind: noop}\n    case:\n      - when: x\n        then: {next: start}\n"
    )
    assert compile_text(V2, case).dialect == "v2case"


# ---------------------------------------------------------------------------------------------
# v2 case


CASE_BODY = """\
workflow:
  - step: start
    tool: {kind: http, url: x}
    case:
      - when: "{{ event.name == 'call.error' and error.status == 500 }}"
        then:
          retry: {max_attempts: 4, backoff_multiplier: 2.0, initial_delay: 0.5}
      - when: "{{ event.name == 'call.done' and response.more }}"
        then:
          collect: {strategy: append, path: data, into: pages}
          retry: {params: {page: "{{ response.page + 1 }}"}}
      - when: "{{ event.name == 'call.done' and not response.more }}"
        then:
          collect: {path: data}
          next: [{step: done}]
  - step: done
"""


def test_case_compiles_to_gated_rules_and_inclusive_arcs() -> None:
    step = compile_text(V2, CASE_BODY).steps["start"]
    assert step.next.mode == "inclusive"
    assert [(a.step, a.when) for a in step.next.arcs] == [
        ("done", "{{ event.name == 'call.done' and not response.more }}")
    ]
    policy = step.tasks[0].policy
    assert policy is not None
    assert [(r.on, r.then.do) for r in policy.rules] == [
        ("error", "retry"),
        ("ok", "retry"),
        ("ok", "continue"),
        ("any", "stop"),
    ]
    retry, page, last, stop = policy.rules
    assert retry.when == "{{ event.name == 'call.error' and error.status == 500 }}"
    assert retry.then == Action(do="retry", attempts=4, delay=0.5, multiplier=2.0, backoff="exponential")
    assert page.then.next_call == {"params": {"page": "{{ response.page + 1 }}"}}
    assert page.then.attempts == DEFAULT_PAGINATION_MAX
    assert page.then.collect == Collect(strategy="append", path="data", into="pages")
    assert last.then.collect == Collect(path="data")
    assert (stop.when, retry.source) == (None, "workflow[0](start).case[0]")


def test_case_unknown_then_key_is_a_problem() -> None:
    body = (
        "workflow:\n  - step: start\n    tool: {kind: noop}\n    case:\n      - when: x\n        then: {nxt: start}\n"
    )
    assert strict_texts(V2, body) == [
        "pb.yaml:10: workflow[0](start).case[0].then.nxt: unknown key 'nxt'; did you mean 'next'?"
    ]


def test_case_policy_needs_a_single_task() -> None:
    body = "workflow:\n  - step: start\n    case:\n      - when: x\n        then: {collect: append}\n"
    assert texts(V2, body) == [
        ("pb.yaml:7: workflow[0](start).case: case: needs exactly one task; this is a step without a tool")
    ]


# ---------------------------------------------------------------------------------------------
# Loops


def test_legacy_loop_collection_element_async_concurrency() -> None:
    body = """\
    workflow:
      - step: start
        tool: {kind: noop}
        loop: {collection: "{{ workload.items }}", element: user, mode: async, concurrency: 3, where: "{{ user.ok }}",
               limit: 10, enumerate: true}
    """
    loop = compile_text(V1, body).steps["start"].loop
    assert loop is not None
    assert loop.model_dump(exclude={"line"}) == {
        "collection": "{{ workload.items }}",
        "cursor": None,
        "iterator": "user",
        "mode": "parallel",
        "max_in_flight": 3,
        "chunk_size": None,
        "batch": 1,
        "enumerate": True,
        "where": "{{ user.ok }}",
        "limit": 10,
        "frame": None,
        "aggregate": False,
        "claim_retry": None,
    }


def test_loop_defaults_per_mode() -> None:
    def loop_of(loop: str) -> object:
        plan = compile_text(V10, f"workflow:\n  - step: start\n    tool: {{kind: noop}}\n    loop: {loop}\n")
        return plan.steps["start"].loop

    parallel = loop_of("{in: [1, 2], iterator: x, spec: {mode: parallel}}")
    assert (parallel.mode, parallel.max_in_flight) == ("parallel", DEFAULT_MAX_IN_FLIGHT)  # type: ignore[attr-defined]
    sequential = loop_of("{in: [1], spec: {mode: sequential, max_in_flight: 5}}")
    assert (sequential.mode, sequential.max_in_flight, sequential.iterator) == ("sequential", 1, "item")  # type: ignore[attr-defined]
    v2_form = loop_of("{in: '{{ xs }}', iterator: x, mode: parallel}")
    assert (v2_form.mode, v2_form.collection) == ("parallel", "{{ xs }}")  # type: ignore[attr-defined]
    chunked = loop_of("{in: [1], mode: chunked, chunk_size: 100}")
    assert (chunked.mode, chunked.chunk_size) == ("chunked", 100)  # type: ignore[attr-defined]


def test_cursor_loop_keeps_cursor_and_frame() -> None:
    body = """\
    workflow:
      - step: start
        tool: {kind: noop}
        loop:
          cursor: {kind: postgres, auth: pg, claim: "UPDATE q SET s = 1 RETURNING id"}
          iterator: row
          spec: {mode: cursor, max_in_flight: 100, frame: {max_rows: 50}}
    """
    loop = compile_text(V10, body).steps["start"].loop
    assert loop is not None
    assert (loop.mode, loop.max_in_flight, loop.iterator, loop.collection) == ("cursor", 100, "row", None)
    assert loop.cursor == {"kind": "postgres", "auth": "pg", "claim": "UPDATE q SET s = 1 RETURNING id"}
    assert loop.frame == {"max_rows": 50}


def test_cursor_loop_rules_are_enforced() -> None:
    head = "workflow:\n  - step: start\n    tool: {kind: noop}\n    loop:\n"
    both = strict_texts(
        V10, head + "      in: [1]\n      cursor: {kind: postgres, claim: x}\n      spec: {mode: cursor}\n"
    )
    assert both == ["pb.yaml:8: workflow[0](start).loop: a loop needs exactly one of in (or collection) and cursor"]
    no_mode = strict_texts(V10, head + "      cursor: {kind: postgres, claim: x}\n      spec: {mode: parallel}\n")
    assert no_mode == ["pb.yaml:10: workflow[0](start).loop.spec.mode: mode: cursor goes with cursor: (and only there)"]
    bad_kind = strict_texts(V10, head + "      cursor: {kind: oracle, claim: x}\n")
    assert bad_kind == [
        (
            "pb.yaml:9: workflow[0](start).loop.cursor.kind: cursor kind 'oracle' is not supported "
            "(known: mysql, nats, postgres, redis_stream, sqlite)"
        )
    ]
    assert compile_text(V10, head + "      cursor: {kind: mysql, table: jobs}\n").steps["start"].loop is not None
    assert compile_text(V10, head + "      cursor: {kind: nats, stream: JOBS}\n").steps["start"].loop is not None
    plan = compile_text(V10, head + "      cursor: {kind: redis_stream, stream: s}\n")  # no claim SQL
    assert plan.steps["start"].loop is not None
    assert plan.steps["start"].loop.cursor == {"kind": "redis_stream", "stream": "s"}
    assert strict_texts(V10, head + "      cursor: {kind: redis_stream, stream: s, max_delivery: 3}\n") == [
        "pb.yaml:9: workflow[0](start).loop.cursor.max_delivery: unknown key 'max_delivery'; "
        "did you mean 'max_deliveries'?"
    ]
    assert strict_texts(V10, head + "      cursor: {kind: postgres}\n") == [
        "pb.yaml:9: workflow[0](start).loop.cursor.claim: must be a non-empty string, not null"
    ]
    bad_retry = strict_texts(V10, head + "      cursor: {kind: sqlite, claim: x, retry: {max_attempt: 2}}\n")
    assert bad_retry == [
        "pb.yaml:9: workflow[0](start).loop.cursor.retry.max_attempt: unknown key 'max_attempt'; "
        "did you mean 'max_attempts'?"
    ]
    on_collection = strict_texts(V10, head + "      in: [1]\n      aggregate: true\n")
    assert on_collection == [
        "pb.yaml:10: workflow[0](start).loop.aggregate: aggregate: only applies to a cursor loop "
        "(a collection loop's result always has its results)"
    ]


def test_unknown_loop_key_is_a_problem_with_suggestion() -> None:
    body = "workflow:\n  - step: start\n    tool: {kind: noop}\n    loop: {in: [1], iteratr: x}\n"
    assert strict_texts(V10, body) == [
        ("pb.yaml:8: workflow[0](start).loop.iteratr: unknown key 'iteratr'; did you mean 'iterator'?")
    ]


# ---------------------------------------------------------------------------------------------
# Retry and policy forms


def retry_rules(retry: str) -> list[Rule]:
    body = f"workflow:\n  - step: start\n    tool: http\n    url: x\n    retry: {retry}\n"
    policy = compile_text(V1, body).steps["start"].tasks[0].policy
    assert policy is not None
    return policy.rules


def test_retry_true_is_three_exponential_attempts_on_error() -> None:
    rules = retry_rules("true")
    assert [(r.on, r.when, r.then) for r in rules] == [
        ("error", None, Action(do="retry", attempts=3, delay=1.0, backoff="exponential")),
        ("any", None, Action(do="stop")),
    ]
    assert rules[0].source == "workflow[0](start).retry"


def test_retry_integer_sets_the_attempts() -> None:
    assert retry_rules("5")[0].then.attempts == 5


def test_retry_flat_mapping_with_retry_when_and_stop_when() -> None:
    rules = retry_rules(
        "{max_attempts: 4, initial_delay: 0.5, backoff_multiplier: 2.0, max_delay: 10, "
        "jitter: true, retry_when: '{{ status_code >= 500 }}', stop_when: '{{ status_code == 200 }}'}"
    )
    assert [(r.on, r.when, r.then.do) for r in rules] == [
        ("any", "{{ status_code == 200 }}", "stop"),
        ("any", "{{ status_code >= 500 }}", "retry"),
        ("any", None, "stop"),
    ]
    assert rules[1].then == Action(
        do="retry", attempts=4, delay=0.5, multiplier=2.0, max_delay=10, jitter=True, backoff="exponential"
    )


def test_retry_flat_mapping_without_retry_when_gates_on_error_without_backoff() -> None:
    rules = retry_rules("{max_attempts: 2}")
    assert (rules[0].on, rules[0].then.backoff, rules[0].then.max_delay) == (
        "error",
        "none",
        DEFAULT_MAX_DELAY,
    )


def test_retry_on_error_and_on_success_blocks() -> None:
    retry = """
      on_error: {when: "{{ error.status == 503 }}", max_attempts: 3, initial_delay: 0.5, backoff_multiplier: 2}
      on_success:
        while: "{{ response.more }}"
        max_attempts: 7
        next_call: {params: {page: "{{ response.page + 1 }}"}}
        collect: {strategy: append, path: data, into: pages}
        per_iteration:
          sink: {tool: postgres, table: t}
    """
    body = "workflow:\n  - step: start\n    tool: http\n    url: x\n    retry:" + textwrap.indent(retry, "  ")
    task = compile_text(V1, body).steps["start"].tasks[0]
    assert task.policy is not None
    on_error, page, last, stop = task.policy.rules
    assert (on_error.on, on_error.when, on_error.then.attempts) == ("error", "{{ error.status == 503 }}", 3)
    assert (page.on, page.when, page.then.do, page.then.attempts) == ("ok", "{{ response.more }}", "retry", 7)
    assert page.then.next_call == {"params": {"page": "{{ response.page + 1 }}"}}
    assert (last.on, last.when, last.then.do, last.then.collect) == (
        "ok",
        None,
        "continue",
        page.then.collect,
    )
    assert (stop.then.do, page.source) == ("stop", "workflow[0](start).retry.on_success")
    assert task.sink is not None and task.sink.config == {"table": "t"}


def test_on_success_without_max_attempts_uses_the_pagination_default() -> None:
    rules = retry_rules("{on_success: {while: '{{ x }}', next_call: {url: y}, collect: append, merge_path: items}}")
    assert rules[0].then.attempts == DEFAULT_PAGINATION_MAX
    assert rules[0].then.collect == Collect(strategy="append", path="items")


def test_unknown_key_inside_on_success_has_path_and_suggestion() -> None:
    body = "workflow:\n  - step: fetch_users\n    tool: http\n    url: x\n    retry:\n      on_success:\n        whille: x\n"
    found = strict_texts(V1, body)
    assert (
        "pb.yaml:11: workflow[0](fetch_users).retry.on_success.whille: unknown key 'whille'; "
        "did you mean 'while'?" in found
    )


def test_retry_rule_list_pagination_and_retry() -> None:
    rules = retry_rules(
        "[{when: '{{ status_code == 500 }}', then: {max_attempts: 2}}, "
        "{when: '{{ response.more }}', then: {next_call: {params: {p: 2}}, collect: {path: d}}}]"
    )
    assert [(r.on, r.then.do) for r in rules] == [
        ("any", "retry"),
        ("ok", "retry"),
        ("ok", "continue"),
        ("any", "stop"),
    ]
    assert rules[1].then.next_call == {"params": {"p": 2}}
    assert rules[2].then.collect == Collect(path="d")


def test_canonical_rules_with_set_alias_fixed_backoff_and_direct_else() -> None:
    body = """\
    workflow:
      - step: start
        tool:
          kind: http
          url: x
          spec:
            policy:
              rules:
                - when: "{{ output.status == 'error' }}"
                  then: {do: retry, attempts: 6, backoff: fixed, delay: 1.0}
                - when: true
                  then: {set: {ctx.a: 1, iter.b: 2, vars.c: 3}}
                - else: {do: fail}
    """
    rules = compile_text(V10, body).steps["start"].tasks[0].policy.rules  # type: ignore[union-attr]
    assert rules[0].then == Action(do="retry", attempts=6, backoff="none", delay=1.0)
    assert (rules[1].when, rules[1].then.set_ctx, rules[1].then.set_iter, rules[1].then.set_vars) == (
        True,
        {"a": 1},
        {"b": 2},
        {"c": 3},
    )
    assert (rules[2].when, rules[2].then.do) == (None, "fail")
    assert rules[0].source == "workflow[0](start).tool.spec.policy.rules[0]"


def test_canonical_retry_without_attempts_gets_the_default() -> None:
    body = "workflow:\n  - step: start\n    tool:\n      kind: noop\n      policy: {rules: [{when: true, then: {do: retry}}]}\n"
    rule = compile_text(V10, body).steps["start"].tasks[0].policy.rules[0]  # type: ignore[union-attr]
    assert rule.then.attempts == 3


def test_unknown_action_and_action_key_are_problems() -> None:
    body = "workflow:\n  - step: start\n    tool:\n      kind: noop\n      spec: {policy: {rules: [{else: {do: retyr, attemps: 2}}]}}\n"
    assert strict_texts(V10, body) == [
        (
            "pb.yaml:9: workflow[0](start).tool.spec.policy.rules[0].else.attemps: unknown key 'attemps'; "
            "did you mean 'attempts'?"
        ),
        (
            "pb.yaml:9: workflow[0](start).tool.spec.policy.rules[0].else.do: unknown action 'retyr'; "
            "did you mean 'retry'?"
        ),
    ]


def test_retry_and_task_policy_together_are_a_problem() -> None:
    body = "workflow:\n  - step: start\n    tool: {kind: noop, policy: {rules: []}}\n    retry: true\n"
    assert texts(V10, body) == [
        ("pb.yaml:8: workflow[0](start).retry: the task already has a policy; give retry: or spec.policy, not both")
    ]


# ---------------------------------------------------------------------------------------------
# Admission


def test_admit_rules_allow_continues_and_deny_breaks() -> None:
    body = """\
    workflow:
      - step: start
        spec:
          policy:
            admit:
              mode: exclusive
              rules:
                - when: "{{ enabled }}"
                  then: {allow: true}
                - else:
                    then: {allow: false}
    """
    admit = compile_text(V10, body).steps["start"].admit
    assert admit is not None
    assert [(r.when, r.then.do) for r in admit] == [("{{ enabled }}", "continue"), (None, "break")]


def test_step_when_is_admission() -> None:
    admit = compile_text(V1, "workflow:\n  - step: start\n    when: '{{ go }}'\n").steps["start"].admit
    assert [(r.when, r.then.do) for r in admit or []] == [("{{ go }}", "continue"), (None, "break")]


def test_admit_unknown_key_is_a_problem() -> None:
    body = "workflow:\n  - step: start\n    spec:\n      policy:\n        admit:\n          rules:\n            - else: {then: {alow: true}}\n"
    found = strict_texts(V10, body)
    assert (
        "pb.yaml:11: workflow[0](start).spec.policy.admit.rules[0].else.then.alow: unknown key 'alow'; "
        "did you mean 'allow'?" in found
    )


def test_step_key_typo_on_a_legacy_tool_step_suggests_the_step_key() -> None:
    found = strict_texts(V1, "workflow:\n  - step: start\n    tool: http\n    url: x\n    nxt: start\n")
    assert found == ["pb.yaml:9: workflow[0](start).nxt: unknown step key 'nxt'; did you mean 'next'?"]


def test_case_for_policy_only_keeps_the_step_next() -> None:
    body = """\
    workflow:
      - step: start
        tool: {kind: http, url: x}
        case:
          - when: "{{ event.name == 'call.error' }}"
            then: {retry: {max_attempts: 2}}
        next: {arcs: [{step: start}]}
    """
    step = compile_text(V2, body).steps["start"]
    assert (step.next.mode, [a.step for a in step.next.arcs]) == ("exclusive", ["start"])
    assert step.tasks[0].policy is not None and step.tasks[0].policy.rules[0].on == "error"


def test_every_spelling_of_max_in_flight_compiles_to_the_plan_s_one_name() -> None:
    """`spec.max_in_flight`, `max_in_flight` and its alias `concurrency` on the loop itself (a
    collection loop or a cursor loop's slots, a number or a template) all become the plan's
    Loop.max_in_flight; the first of them given counts."""

    def loop_of(loop: str) -> object:
        plan = compile_text(
            V10, f"workload: {{n: 6}}\nworkflow:\n  - step: start\n    tool: {{kind: noop}}\n    loop: {loop}\n"
        )
        return plan.steps["start"].loop

    claim = 'cursor: {kind: postgres, auth: pg, claim: "UPDATE q SET s = 1 RETURNING id"}'
    for loop, expected in (
        ("{in: [1], iterator: x, spec: {mode: parallel, max_in_flight: 4}}", 4),
        ("{in: [1], iterator: x, mode: parallel, max_in_flight: 4}", 4),
        ("{in: [1], iterator: x, mode: parallel, concurrency: 4}", 4),
        ("{collection: [1], element: x, mode: async, concurrency: 4}", 4),
        ("{in: [1], iterator: x, mode: parallel, concurrency: '{{ n }}'}", 6),
        ("{in: [1], iterator: x, mode: parallel, concurrency: 3, spec: {max_in_flight: 4}}", 4),
        (f"{{{claim}, iterator: row, spec: {{mode: cursor, max_in_flight: 5}}}}", 5),
        (f"{{{claim}, iterator: row, concurrency: 5, spec: {{mode: cursor}}}}", 5),
    ):
        assert loop_of(loop).max_in_flight == expected, loop  # type: ignore[attr-defined]
