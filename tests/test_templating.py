"""The one template environment: native values, strict names, legacy aliases, no re-rendering."""

from __future__ import annotations

import json

import pytest

from noetl_celery.core.errors import TemplateError
from noetl_celery.templates.render import (
    LoopResult,
    as_step_result,
    check_syntax,
    evaluate_condition,
    render_string,
    render_value,
    response_view,
    rows_result,
)


def test_a_lone_expression_renders_to_its_native_value():
    ctx = {"items": [1, 2], "n": 3, "page": {"page": "2"}}
    assert render_string("{{ items }}", ctx) == [1, 2]
    assert render_string("{{ (page.page | int) + 1 }}", ctx) == 3
    assert render_string(" {{ n }} ", ctx) == 3
    assert render_string("id-{{ n }}", ctx) == "id-3"
    assert render_string("{{ n }}{{ n }}", ctx) == "33"


def test_undefined_names_are_errors_that_quote_the_template():
    with pytest.raises(TemplateError, match="'missing' is undefined in template '{{ missing.x }}'"):
        render_string("{{ missing.x }}", {})
    with pytest.raises(TemplateError, match="has no attribute 'square'"):
        render_string("{{ rows | map(attribute='square') | list }}", {"rows": [None]})
    assert render_string("{{ missing | default(5) }}", {}) == 5


def test_keys_win_over_dict_methods():
    assert render_string("{{ iter.items }}", {"iter": {"items": [7]}}) == [7]
    assert render_string("{{ d.keys }}", {"d": {"keys": "k"}}) == "k"


def test_legacy_result_aliases():
    step = as_step_result({"status": "success", "data": {"message": "hi"}})
    assert render_string("{{ test_step.result.data.message }}", {"test_step": step}) == "hi"
    flat = as_step_result({"item_name": "a"})
    assert render_string("{{ result.data.item_name }}", {"result": flat}) == "a"
    pipeline = as_step_result({"count": 2}, {"validate": {"ok": True}, "transform": {"items": 2}})
    assert render_string("{{ p.results.transform.items }}", {"p": pipeline}) == 2
    assert render_string("{{ p.validate.ok }}", {"p": pipeline}) is True


def test_a_loop_result_answers_its_iteration_results_by_the_legacy_aliases():
    loop = LoopResult({"results": [{"score": 1}, {"score": 2}], "stats": {"total": 2}})
    assert render_string("{{ users.data | map(attribute='score') | list }}", {"users": loop}) == [1, 2]
    assert render_string("{{ users.result | length }}", {"users": loop}) == 2
    assert render_string("{{ users.stats.total }}", {"users": loop}) == 2  # the mapping itself is kept
    assert render_string("{{ users.results[1].score }}", {"users": loop}) == 2


def test_response_reads_the_http_result_and_then_the_body():
    response = response_view(
        {
            "status_code": 200,
            "headers": {},
            "url": "u",
            "elapsed": 0.1,
            "data": {"paging": {"hasMore": True}, "data": [1]},
        }
    )
    assert render_string("{{ response.paging.hasMore }}", {"response": response}) is True
    assert render_string("{{ response.data.paging.hasMore }}", {"response": response}) is True
    assert render_string("{{ response.status_code }}", {"response": response}) == 200


def test_data_is_never_rendered_again():
    ctx = {"body": {"sql": "{{ execution_id }}"}, "execution_id": 1}
    assert render_string("{{ body.sql }}", ctx) == "{{ execution_id }}"
    assert render_value({"q": "{{ body }}", "code": "{{ x }}"}, ctx, raw_keys=frozenset({"code"})) == {
        "q": {"sql": "{{ execution_id }}"},
        "code": "{{ x }}",
    }


def test_the_sandbox_refuses_unsafe_attributes():
    with pytest.raises(TemplateError):
        render_string("{{ ''.__class__.__mro__[1].__subclasses__() }}", {})


@pytest.mark.parametrize(
    "condition, expected",
    [
        (None, True),
        (True, True),
        (False, False),
        ("{{ 1 > 2 }}", False),
        ("{{ 'false' }}", False),
        ("{{ [] }}", False),
        ("{{ 'yes' }}", True),
        ("{{ x == 1 }}", True),
    ],
)
def test_conditions(condition, expected):
    assert evaluate_condition(condition, {"x": 1}) is expected


def test_a_sql_result_reads_in_both_noetl_forms_wherever_it_is_found():
    flat = {"status": "success", "rows": [{"a": 1}], "row_count": 1, "columns": ["a"], "statement_count": 1}
    numbered = {"status": "success", "statement_count": 2, "command_0": {"rows": [], "row_count": 0, "columns": []}}
    numbered["command_1"] = {"rows": [{"b": 2}], "row_count": 1, "columns": ["b"]}
    ctx = {"one": as_step_result(flat), "two": as_step_result(numbered), "loop": {"results": [flat, numbered]}}
    assert render_string("{{ one.command_0.rows[0].a }}", ctx) == 1
    assert render_string("{{ one['command_0']['row_count'] }}", ctx) == 1
    assert render_string("{{ two.rows[0].b }}", ctx) == 2 and render_string("{{ two.columns }}", ctx) == ["b"]
    # a plain result inside another value (a loop's per-iteration results) answers both forms too
    assert render_string("{{ loop.results[0].command_0.rows[0].a }}", ctx) == 1
    assert render_string("{{ loop.results[1]['rows'][0].b }}", ctx) == 2
    # the view adds the other form without copying the rows
    assert ctx["one"]["command_0"]["rows"] is flat["rows"]
    # a mapping that is not a SQL result (no statement_count) gains nothing
    with pytest.raises(TemplateError):
        render_string("{{ x.command_0 }}", {"x": {"rows": [], "row_count": 0, "columns": []}})


def test_a_duckdb_result_reads_as_its_rows_and_keeps_its_fields():
    stored = {"rows": [{"a": 1}, {"a": 2}], "row_count": 2, "columns": ["a"], "database": ":memory:"}
    stored["command_0"] = {"rows": stored["rows"], "row_count": 2, "columns": ["a"]}
    ctx = {"q": rows_result(stored)}
    assert render_string("{{ q }}", ctx) == [{"a": 1}, {"a": 2}]
    assert type(render_string("{{ q }}", ctx)) is list
    assert render_string("{{ q | length }}", ctx) == 2
    assert render_string("{{ q[1].a }}", ctx) == 2
    assert render_string("{{ q.rows }}", ctx) == [{"a": 1}, {"a": 2}]
    assert render_string("{{ q.row_count }}", ctx) == 2
    assert render_string("{{ q['columns'] }}", ctx) == ["a"]
    assert render_string("{{ q.command_0.rows[0].a }}", ctx) == 1
    assert render_string("{{ q.result | length }}", ctx) == 2
    failed = {"error": "boom"}
    assert render_string("{{ q.error }}", {"q": rows_result(failed)}) == "boom"


def test_a_truncated_result_cannot_be_iterated_but_its_marker_fields_read():
    from noetl_celery.config import limits
    from noetl_celery.templates.render import as_step_result

    big = as_step_result(limits.cap(list(range(300_000))))
    context = {"start": big, "http": {"status_code": 200, "data": dict(big)}}
    for template in (
        "{% for k in start %}{{ k }}{% endfor %}",
        "{{ start | list }}",
        "{{ start | join(',') }}",
        "{{ start.items }}",
        "{% for k in http.data %}{{ k }}{% endfor %}",
        "{{ http['data'] | list }}",
    ):
        with pytest.raises(TemplateError) as info:
            render_string(template, context)
        assert "truncated when stored" in str(info.value) and "NOETL_MAX_RESULT_BYTES" in str(info.value), template
    assert render_string("{{ start.size }}", context) == big["size"]
    assert render_string("{{ start.sha256 }}", context) == big["sha256"]
    assert render_string("{{ start | length }}", context) == len(big)
    assert render_string("{{ http.data.size }}", context) == big["size"]
    assert render_string("{{ http.data }}", context) == dict(big)  # passed on whole, as the marker
    assert json.loads(json.dumps(big)) == dict(big)  # stored and sent as the marker it is


def test_a_go_template_action_stays_in_the_text_as_written():
    """docker/podman/kubectl --format strings in a shell command: NoETL leaves them as written."""
    ctx = {"workload": {"repo": "local/noetl"}}
    command = 'podman images --format "{{.Repository}}:{{.Tag}}" | grep {{ workload.repo }}'
    assert render_string(command, ctx) == 'podman images --format "{{.Repository}}:{{.Tag}}" | grep local/noetl'
    assert render_string("{{.ID}}", ctx) == "{{.ID}}"
    assert render_string("{{ .Names }} {{- workload.repo }}", ctx) == "{{ .Names }}local/noetl"
    assert check_syntax('docker ps --format "{{ .ID }}" {{ workload.repo | upper }}') is None
    assert check_syntax("{{ . }}") is not None  # a lone dot is no Go field: still a Jinja error
