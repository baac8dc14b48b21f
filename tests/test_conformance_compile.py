"""NoETL conformance at compile time: what NoETL users write is accepted, and what is wrong is
explained in our words, at the right line. One behaviour per test, on small inline playbooks."""

from __future__ import annotations

import textwrap

import pytest

from noetl_celery.core.errors import PlaybookError, Problem, TemplateError
from noetl_celery.dsl import load_plan
from noetl_celery.dsl.plan import Plan
from noetl_celery.engine.arc_args import merge_arc_args
from noetl_celery.engine.decision.select import select_part
from noetl_celery.templates.render import as_step_result, render_string

FILE = "pb.yaml"
V1 = "apiVersion: noetl.io/v1\nkind: Playbook\nmetadata:\n  name: t\n"
V2 = "apiVersion: noetl.io/v2\nkind: Playbook\nmetadata:\n  name: t\n"


def compile_text(head: str, body: str) -> Plan:
    return load_plan(FILE, text=head + textwrap.dedent(body))


def texts(head: str, body: str) -> list[str]:
    with pytest.raises(PlaybookError) as raised:
        compile_text(head, body)
    return [str(p) for p in raised.value.problems]


def strict_texts(head: str, body: str) -> list[str]:
    """What `validate --strict` prints: the warnings of a playbook that otherwise validates."""
    warnings: list[Problem] = []
    load_plan(FILE, text=head + textwrap.dedent(body), warnings=warnings)
    return [str(p) for p in warnings]


# --- renames era -----------------------------------------------------------------------------


def test_step_set_bare_keys_are_ctx_variables_beside_prefixed_ones() -> None:
    body = """\
    workflow:
      - step: start
        set: {page: "{{ output.data.page }}", ctx.size: 10, vars.seen: true}
    """
    step = compile_text(V2, body).steps["start"]
    assert step.set_ctx == {"page": "{{ output.data.page }}", "size": 10}
    assert step.vars == {"seen": True}


def test_step_set_bare_key_and_its_ctx_form_twice_is_a_problem() -> None:
    found = texts(V2, "workflow:\n  - step: start\n    set: {page: 1, ctx.page: 2}\n")
    assert found == ["pb.yaml:7: workflow[0](start).set.ctx.page: 'page' is assigned twice"]


def test_step_input_is_the_steps_args() -> None:
    body = """\
    workflow:
      - step: start
        input: {x: 1}
        tool: {kind: python, code: "def main(x):\\n    return x"}
    """
    assert compile_text(V2, body).steps["start"].tasks[0].config["args"] == {"x": 1}


# --- arc args ----------------------------------------------------------------------------------


def test_args_beside_then_go_with_every_branch_and_a_branchs_own_win() -> None:
    body = """\
    workflow:
      - step: start
        next:
          - when: "{{ go }}"
            then: [{step: a, args: {y: 2}}]
            else: [b]
            args: {x: 1, y: 1}
      - step: a
      - step: b
    """
    arcs = compile_text(V1, body).steps["start"].next.arcs
    assert [(a.step, a.negate, a.args) for a in arcs] == [("a", False, {"x": 1, "y": 2}), ("b", True, {"x": 1, "y": 1})]


def test_arc_args_merge_over_the_steps_own_args_but_not_into_a_table_write() -> None:
    assert merge_arc_args("python", {"code": "x", "args": {"x": None, "z": 3}}, {"x": 41}) == {
        "code": "x",
        "args": {"x": 41, "z": 3},
    }
    assert merge_arc_args("python", {"code": "x"}, {"x": 41})["args"] == {"x": 41}
    table_write = {"table": "t", "args": {"id": 1}}
    assert merge_arc_args("postgres", table_write, {"x": 41}) == table_write
    assert merge_arc_args("http", {"url": "u"}, {"x": 41}) == {"url": "u"}  # http takes no args


# --- result aliases and templates --------------------------------------------------------------


@pytest.mark.parametrize("value", [[1, 2], "text", 7, 2.5, {"a": 1}])
def test_every_result_type_answers_result_and_data(value) -> None:
    context = {"step": as_step_result(value)}
    assert render_string("{{ step.result }}", context) == value
    assert render_string("{{ step.data }}", context) == value
    if not isinstance(value, dict):  # a wrapped list or scalar comes out as its plain type
        assert type(render_string("{{ step.result }}", context)) is type(value)


def test_a_missing_attribute_of_a_list_result_names_the_plain_type() -> None:
    with pytest.raises(TemplateError, match="'list object' has no attribute 'nope'"):
        render_string("{{ step.nope }}", {"step": as_step_result([1])})


def test_a_lone_tojson_expression_passes_the_structure_and_text_stays_text() -> None:
    assert render_string("{{ x | tojson }}", {"x": {"a": [1]}}) == {"a": [1]}
    assert render_string("v={{ x | tojson }}", {"x": {"a": 1}}) == 'v={"a": 1}'


def test_output_select_keeps_a_path_or_a_template_and_names_a_missing_key() -> None:
    data = {"data": {"items": [{"id": 5}]}}
    assert select_part(data, "data.items.0.id", {}) == 5
    assert select_part(data, "{{ result.data['items'] | length }}", {}) == 1
    with pytest.raises(TemplateError, match="output_select 'data.rows': data has no 'rows'"):
        select_part(data, "data.rows", {})


def test_result_and_output_hints_select_and_keep_the_rest_as_advisory() -> None:
    body = """\
    workflow:
      - step: start
        tool: {kind: python, code: "def main():\\n    return 1"}
        result: {output_select: data.items, storage: kv}
        output: {format: json}
    """
    step = compile_text(V2, body).steps["start"]
    assert step.result_select == "data.items"
    assert step.result_hints == {"result.storage": "kv", "output.format": "json"}


def test_two_result_selectors_are_a_problem() -> None:
    body = "workflow:\n  - step: start\n    result: {output_select: a}\n    output: {select: b}\n"
    assert texts(V2, body) == [
        "pb.yaml:8: workflow[0](start).output.select: the result is selected twice; give one selector"
    ]


# --- v2 case actions ---------------------------------------------------------------------------


def test_case_then_list_set_and_result() -> None:
    body = """\
    workflow:
      - step: start
        tool: {kind: python, code: "def main():\\n    return 1"}
        case:
          - when: "{{ event.name == 'call.done' }}"
            then:
              - set: {n: "{{ result }}", vars.v: 1}
              - result: {wrapped: "{{ result }}"}
          - when: "{{ event.name == 'step.exit' }}"
            then:
              - set: {done: true}
              - next: [{step: end}]
      - step: end
    """
    step = compile_text(V2, body).steps["start"]
    policy = step.tasks[0].policy
    assert policy is not None
    action = policy.rules[0].then
    assert (action.do, action.set_ctx, action.set_vars) == ("continue", {"n": "{{ result }}"}, {"v": 1})
    assert action.sets_result and action.result == {"wrapped": "{{ result }}"}
    assert [(a.step, a.set_ctx) for a in step.next.arcs] == [("end", {"done": True})]


def test_case_then_list_with_an_action_twice_is_a_problem() -> None:
    body = """\
    workflow:
      - step: start
        tool: {kind: python, code: "def main():\\n    return 1"}
        case:
          - when: "{{ true }}"
            then:
              - set: {a: 1}
              - set: {b: 1}
    """
    assert texts(V2, body) == [
        "pb.yaml:12: workflow[0](start).case[0].then[1].set: 'set' is given twice in this then list (first at line 11)"
    ]


# --- messages ----------------------------------------------------------------------------------


def test_yaml_indentation_mistake_is_explained_at_its_line() -> None:
    found = texts(V2, "workflow:\n  - step: start\n    tool: python\n      code: x\n")
    assert len(found) == 1
    assert found[0].startswith("pb.yaml:8: invalid YAML: indentation: 'code: x' is indented deeper")


def test_yaml_missing_colon_is_reported_at_its_own_line_not_the_next() -> None:
    found = texts(V2, "workflow:\n  - step: start\n    next end\n    desc: x\n")
    assert found == [
        "pb.yaml:7: invalid YAML: 'next end' is not `key: value` (a key needs ': ' after it) nor a list item ('- ...')"
    ]


def test_yaml_tab_and_unquoted_template_are_explained() -> None:
    assert texts(V2, "workflow:\n\t- step: start\n") == [
        "pb.yaml:6: invalid YAML: indentation: a tab character; YAML indents with spaces only"
    ]
    found = texts(V2, "workload:\n  msg: {{ x }}\nworkflow:\n  - step: start\n")
    assert found == [
        "pb.yaml:6: workload.msg: a mapping key must be a scalar (a template value '{{ ... }}' must be quoted)"
    ]


@pytest.mark.parametrize(
    "head, tool",
    [
        (V2, "tool: {kind: workbook, task: calc, with: {x: 1}}"),
        (V1, "tool: workbook\n    task: calc\n    with: {x: 1}"),
    ],
)
def test_a_workbook_call_with_task_and_with_is_noetls_spelling(head, tool) -> None:
    """`task:` names the entry (NoETL's key in every era), `with:` its arguments (the older era)."""
    body = (
        "workbook:\n  - name: calc\n    tool: python\n    code: 'def main(x):\\n    return x'\n"
        f"workflow:\n  - step: start\n    {tool}\n"
    )
    plan = compile_text(head, body)
    task = plan.steps["start"].tasks[0]
    assert (task.kind, task.config["args"]) == ("python", {"x": 1})
    both = body.replace("task: calc", "task: calc, name: calc" if head == V2 else "task: calc\n    name: calc")
    found = texts(head, both)
    assert len(found) == 1 and "give task: or name:, not both" in found[0], found


def test_a_misspelt_step_key_on_a_legacy_postgres_step_is_a_step_key() -> None:
    body = "workflow:\n  - step: start\n    tool: postgres\n    command: select 1\n    nxt: start\n"
    assert strict_texts(V1, body) == ["pb.yaml:9: workflow[0](start).nxt: unknown step key 'nxt'; did you mean 'next'?"]


def test_a_misspelt_tool_field_is_still_named_for_its_tool() -> None:
    body = "workflow:\n  - step: start\n    tool: postgres\n    comand: select 1\n"
    found = texts(V1, body)
    assert (
        "pb.yaml:8: workflow[0](start).comand: unknown key 'comand' for the postgres tool; "
        "did you mean 'command'?" in found
    )


@pytest.mark.parametrize(
    "template, what",
    [
        ("{{ x | no_such_filter }}", "No filter named 'no_such_filter'"),
        ("{{ x is no_such_test }}", "No test named 'no_such_test'"),
    ],
)
def test_validate_knows_the_runtimes_filters_and_tests(template, what) -> None:
    found = texts(V2, f'workflow:\n  - step: start\n    args: {{a: "{template}"}}\n')
    assert found == [f"pb.yaml:7: workflow[0](start).args.a: template uses what does not exist (its line 1): {what}."]


def test_validate_accepts_the_runtimes_own_filters() -> None:
    body = 'workflow:\n  - step: start\n    args: {a: "{{ x | b64encode | fromjson | to_json }}"}\n'
    assert compile_text(V2, body).steps["start"]


def test_compile_shows_the_result_selector_and_the_advisory_hints() -> None:
    from noetl_celery.compiler import describe

    body = """\
    workflow:
      - step: start
        tool: {kind: python, code: "def main():\\n    return 1"}
        output: {select: rows, storage: kv}
    """
    (step,) = describe(compile_text(V2, body))["steps"]
    assert step["result"] == {"select": "rows", "advisory": {"output.storage": "kv"}}


def test_policy_conditions_read_the_aliases_of_a_list_result() -> None:
    from noetl_celery.engine.decision.policy_eval import outcome_scope
    from noetl_celery.templates.render import evaluate_condition

    scope = outcome_scope({"status": "ok", "data": [1, 2]}, attempt=1)
    assert evaluate_condition("{{ result.data | length == 2 and result.result[0] == 1 }}", scope)
