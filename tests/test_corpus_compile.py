"""The conformance corpus: every real NoETL playbook normalises, every broken one is rejected.

The corpus lives outside the package (`/work/shared/noetl-corpus`, or NOETL_CORPUS_DIR).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from noetl_celery.core.errors import PlaybookError
from noetl_celery.dsl import load_plan
from noetl_celery.dsl.plan import DEFAULT_PAGINATION_MAX, Collect, Plan
from tests.support.corpus import CORPUS, MISSING_REASON

pytestmark = pytest.mark.skipif(not CORPUS.is_dir(), reason=MISSING_REASON)


def corpus_files() -> list[str]:
    if not CORPUS.is_dir():
        return []
    return sorted(str(path.relative_to(CORPUS)) for path in CORPUS.rglob("*.yaml"))


VALID = [
    name for name in corpus_files() if not Path(name).name.startswith("broken_") or name.endswith("broken_sql.yaml")
]


def plan_of(name: str) -> Plan:
    return load_plan(CORPUS / name)


def test_the_corpus_is_where_the_index_says() -> None:
    listed = {line.split("\t")[1] for line in (CORPUS / "INDEX.tsv").read_text().splitlines()[1:] if line.strip()}
    assert listed == set(corpus_files())


@pytest.mark.parametrize("name", VALID)
def test_valid_playbook_normalises_without_problems(name: str) -> None:
    plan = plan_of(name)
    assert plan.steps and plan.entry_step in plan.steps
    plan.model_dump_json()  # stored with the execution: must serialise


def test_pft_flow_compiles_with_its_mds_sub_playbook_resolved_beside_it() -> None:
    from noetl_celery.compiler import compile_playbook

    plan = compile_playbook(CORPUS / "cursor" / "pft_flow.yaml")  # a missing child would raise here
    task = plan.steps["run_mds_batch_workers"].tasks[0]
    assert task.kind == "playbook"
    assert task.config["path"] == "tests/fixtures/playbooks/pft_flow_test/test_mds_batch_worker"
    assert task.config["return_step"] == "end"


def test_legacy_broken_fixture_names_the_dash_step_key_and_its_line() -> None:
    with pytest.raises(PlaybookError) as raised:
        plan_of("legacy-2025-12/broken_tool_is_required.yaml")
    assert [(p.line, p.path, p.message) for p in raised.value.problems] == [
        (27, "workflow[1](insert_report).next.-step", "unknown key '-step'; did you mean 'step'?")
    ]
    assert "broken_tool_is_required.yaml:27:" in str(raised.value) and "-step" in str(raised.value)


def test_v10_broken_fixture_names_the_misplaced_command_and_the_missing_field() -> None:
    with pytest.raises(PlaybookError) as raised:
        plan_of("v10-2026-02/broken_tool_is_required.yaml")
    assert [(p.line, p.path, p.message) for p in raised.value.problems] == [
        (
            26,
            "workflow[1](insert_report).tool",
            "postgres tool needs one of: command, query, script, sql, statement, table",
        ),
        (
            29,
            "workflow[1](insert_report).command",
            "'command' is a field of the postgres tool; put it under tool",
        ),
    ]
    assert "broken_tool_is_required.yaml:29:" in str(raised.value)


# ---------------------------------------------------------------------------------------------
# Normalised details, per corpus file


def arcs(plan: Plan, step: str) -> list[tuple[str, object]]:
    return [(arc.step, arc.when) for arc in plan.steps[step].next.arcs]


def kinds(plan: Plan, step: str) -> list[tuple[str, str]]:
    return [(task.label, task.kind) for task in plan.steps[step].tasks]


def actions(plan: Plan, step: str, task: int = 0) -> list[tuple[str, str]]:
    policy = plan.steps[step].tasks[task].policy
    return [(rule.on, rule.then.do) for rule in policy.rules] if policy else []


def check_legacy_hello_world(plan: Plan) -> None:
    assert plan.dialect == "legacy" and list(plan.steps) == ["start", "test_step", "end"]
    assert plan.steps["start"].tasks == []
    assert plan.steps["start"].next.arcs[0].args == {"message": "{{ workload.message }}"}
    assert kinds(plan, "test_step") == [("test_step", "python")]
    sink = plan.steps["end"].tasks[0].sink
    assert kinds(plan, "end") == [("end", "noop")] and sink is not None and sink.kind == "event_log"


def check_legacy_pagination_basic(plan: Plan) -> None:
    task = plan.steps["fetch_all_assessments"].tasks[0]
    assert task.config["params"] == {"page": 1, "pageSize": 10}
    assert actions(plan, "fetch_all_assessments") == [("ok", "retry"), ("ok", "continue"), ("any", "stop")]
    page = task.policy.rules[0]  # type: ignore[union-attr]
    assert (page.when, page.then.attempts) == ("{{ response.paging.hasMore == true }}", 10)
    assert page.then.collect == Collect(strategy="append", path="data", into="pages")


def check_legacy_pagination_offset(plan: Plan) -> None:
    page = plan.steps["fetch_all_users"].tasks[0].policy.rules[0]  # type: ignore[union-attr]
    assert page.then.next_call == {
        "params": {
            "offset": "{{ (response.offset | int) + (response.limit | int) }}",
            "limit": "{{ response.limit }}",
        }
    }
    assert page.then.collect == Collect(path="users", into="pages")


def check_legacy_pagination_cursor(plan: Plan) -> None:
    page = plan.steps["fetch_all_events"].tasks[0].policy.rules[0]  # type: ignore[union-attr]
    assert page.when == "{{ response.next_cursor is not none and response.next_cursor != '' }}"
    assert page.then.collect == Collect(path="events", into="pages")


def check_legacy_pagination_retry(plan: Plan) -> None:
    assert actions(plan, "fetch_with_retry") == [
        ("error", "retry"),
        ("ok", "retry"),
        ("ok", "continue"),
        ("any", "stop"),
    ]
    retry = plan.steps["fetch_with_retry"].tasks[0].policy.rules[0]  # type: ignore[union-attr]
    assert (retry.then.attempts, retry.then.delay, retry.then.multiplier) == (3, 0.5, 2.0)


def check_legacy_max_iterations(plan: Plan) -> None:
    assert plan.steps["fetch_with_limit"].tasks[0].policy.rules[0].then.attempts == 2  # type: ignore[union-attr]


def check_legacy_loop_with_pagination(plan: Plan) -> None:
    loop = plan.steps["fetch_all_endpoints"].loop
    assert loop is not None
    assert (loop.collection, loop.iterator, loop.mode, loop.max_in_flight) == (
        "{{ workload.endpoints }}",
        "endpoint",
        "sequential",
        1,
    )
    assert actions(plan, "fetch_all_endpoints")[0] == ("ok", "retry")
    assert plan.steps["verify_saved_data"].tasks[0].auth == "pg_k8s"


def check_legacy_retry_simple_config(plan: Plan) -> None:
    assert plan.steps["boolean_retry"].tasks[0].policy.rules[0].then.attempts == 3  # type: ignore[union-attr]
    assert plan.steps["integer_retry"].tasks[0].policy.rules[0].then.attempts == 5  # type: ignore[union-attr]
    assert actions(plan, "full_config_retry") == [("any", "stop"), ("any", "retry"), ("any", "stop")]


def check_legacy_retry_python_exception(plan: Plan) -> None:
    rule = plan.steps["start"].tasks[0].policy.rules[0]  # type: ignore[union-attr]
    assert (rule.on, rule.when, rule.then.attempts, rule.then.max_delay) == (
        "any",
        "{{ error != None }}",
        5,
        2.0,
    )


def check_legacy_iterator_save(plan: Plan) -> None:
    step = plan.steps["process_items"]
    assert step.loop is not None and (step.loop.iterator, step.loop.mode) == ("item", "sequential")
    sink = step.tasks[0].sink
    assert sink is not None and (sink.kind, sink.config["mode"], sink.config["key"]) == (
        "postgres",
        "upsert",
        "id",
    )


def check_legacy_control_flow_workbook(plan: Plan) -> None:
    task = plan.steps["eval_flag"].tasks[0]
    assert (task.kind, task.config["args"]) == ("python", {"temperature_c": "{{ workload.temperature_c }}"})
    assert "def main(temperature_c)" in task.config["code"]
    assert arcs(plan, "eval_flag") == [
        ("hot_path", "{{ result.is_hot == true }}"),
        ("cold_path", "{{ result.is_hot == false }}"),
    ]
    assert plan.steps["hot_path"].tasks == [] and plan.steps["hot_path"].next.mode == "inclusive"
    assert arcs(plan, "hot_path") == [("hot_task_a", None), ("hot_task_b", None)]


def check_legacy_vars_block(plan: Plan) -> None:
    assert plan.steps["fetch_data"].vars["first_user_id"] == "{{ result.users[0].user_id }}"
    assert plan.steps["use_extracted_vars"].tasks[0].config["args"]["user_count"] == "{{ vars.user_count }}"


def check_legacy_broken_sql(plan: Plan) -> None:
    assert kinds(plan, "verify_pg_data") == [("verify_pg_data", "postgres")]
    assert plan.steps["verify_pg_data"].tasks[0].auth == "{{ workload.pg_auth }}"


def check_v2case_pagination_retry(plan: Plan) -> None:
    assert plan.dialect == "v2case"
    assert actions(plan, "fetch_with_retry") == [
        ("error", "retry"),
        ("ok", "retry"),
        ("ok", "continue"),
        ("any", "stop"),
    ]
    assert [a.step for a in plan.steps["fetch_with_retry"].next.arcs] == ["validate_results"]
    assert arcs(plan, "start") == [("fetch_with_retry", "{{ event.name == 'step.exit' }}")]


def check_v2case_loop_with_pagination(plan: Plan) -> None:
    step = plan.steps["fetch_all_endpoints"]
    assert step.loop is not None and (step.loop.collection, step.loop.iterator) == (
        "{{ workload.endpoints }}",
        "endpoint",
    )
    page = step.tasks[0].policy.rules[1]  # type: ignore[union-attr]
    assert (page.then.attempts, page.then.collect.path) == (DEFAULT_PAGINATION_MAX, "data.data")  # type: ignore[union-attr]
    assert arcs(plan, "fetch_all_endpoints") == [("validate_results", "{{ event.name == 'loop.done' }}")]


def check_v10_hello_world(plan: Plan) -> None:
    assert plan.dialect == "canonical" and plan.steps["test_step"].next.mode == "exclusive"
    assert plan.steps["test_step"].tasks[0].config["args"] == {"message": "{{ message }}"}


def check_v10_canonical_example(plan: Plan) -> None:
    assert [r.then.do for r in plan.steps["start"].admit or []] == ["continue", "break"]
    assert kinds(plan, "process_data") == [("validate", "python"), ("transform", "python")]
    loop = plan.steps["store_results"].loop
    assert loop is not None and (loop.mode, loop.max_in_flight) == ("parallel", 5)
    fetch = plan.steps["fetch_data"].tasks[0].policy.rules  # type: ignore[union-attr]
    assert [r.then.do for r in fetch] == ["retry", "fail", "continue"]
    assert fetch[2].then.set_ctx == {"fetch_completed": True}


def check_v10_http_pagination_jump(plan: Plan) -> None:
    assert plan.ctx == {"current_page": 1, "all_pages": []}
    assert kinds(plan, "fetch_paginated") == [
        ("init", "noop"),
        ("fetch_page", "http"),
        ("collect_items", "python"),
        ("paginate", "noop"),
    ]
    fetch = plan.steps["fetch_paginated"].tasks[1]
    assert fetch.config["endpoint"] == "{{ api_url }}/data" and "policy" not in fetch.config
    jump = plan.steps["fetch_paginated"].tasks[3].policy.rules[0]  # type: ignore[union-attr]
    assert (jump.then.do, jump.then.to) == ("jump", "fetch_page")
    assert plan.steps["fetch_paginated"].next.arcs[0].args == {"items": "{{ ctx.all_pages }}"}


def check_v10_iterator_save(plan: Plan) -> None:
    assert kinds(plan, "process_items") == [("process_item", "python"), ("save_item", "postgres")]
    first = plan.steps["process_items"].tasks[0].policy.rules[0]  # type: ignore[union-attr]
    assert (first.when, first.then.set_iter) == (True, {"processed_item": "{{ outcome.result }}"})


def check_v10_loop_instance_isolation(plan: Plan) -> None:
    assert plan.steps["process_items_users"].tasks[0].config["args"] == {"user": "{{ user }}"}
    loop = plan.steps["process_items_products"].loop
    assert loop is not None and (loop.iterator, loop.mode) == ("product", "sequential")


def check_v10_loop_with_pagination(plan: Plan) -> None:
    assert kinds(plan, "fetch_page") == [
        ("fetch", "http"),
        ("save_page", "postgres"),
        ("check_pagination", "python"),
    ]
    assert plan.steps["fetch_page"].tasks[1].auth == {"type": "postgres", "credential": "pg_k8s"}
    assert plan.steps["init_endpoint_loop"].set_ctx == {
        "current_endpoint": "{{ init_endpoint_loop.endpoint }}",
        "current_page": 1,
    }


def check_v10_pagination_basic(plan: Plan) -> None:
    assert arcs(plan, "check_pagination") == [
        ("fetch_page", "{{ ctx.has_more == true }}"),
        ("validate_results", "{{ ctx.has_more != true }}"),
    ]


def check_v10_pagination_retry(plan: Plan) -> None:
    rules = plan.steps["fetch_with_retry"].tasks[0].policy.rules  # type: ignore[union-attr]
    assert [(r.then.do, r.then.backoff) for r in rules] == [
        ("retry", "exponential"),
        ("retry", "linear"),
        ("fail", "none"),
        ("continue", "none"),
    ]


def check_v10_pipeline_error_handling(plan: Plan) -> None:
    assert kinds(plan, "test_rate_limit") == [
        ("fetch_1", "http"),
        ("fetch_2", "http"),
        ("validate", "python"),
    ]
    assert kinds(plan, "end") == [("end", "noop")]


def check_v10_retry_simple_config(plan: Plan) -> None:
    rule = plan.steps["integer_retry"].tasks[0].policy.rules[0]  # type: ignore[union-attr]
    assert (rule.then.attempts, rule.then.delay) == (5, 0.5)


def check_v10_control_flow_workbook(plan: Plan) -> None:
    assert plan.steps["eval_flag"].tasks[0].config["args"] == {"temperature_c": "{{ temperature_c }}"}
    assert plan.steps["hot_path"].next.mode == "inclusive"  # `mode: parallel`


def check_cursor_page_continuation(plan: Plan) -> None:
    loop = plan.steps["fetch_pages"].loop
    assert loop is not None and (loop.mode, loop.iterator, loop.max_in_flight) == ("cursor", "page", 1)
    assert loop.cursor is not None and "FOR UPDATE SKIP LOCKED" in loop.cursor["claim"]
    assert loop.frame is not None and loop.frame["max_rows"] == 50
    assert kinds(plan, "fetch_pages") == [("fetch_record", "http"), ("save_record", "postgres")]
    last = plan.steps["fetch_pages"].tasks[0].policy.rules[-1]  # type: ignore[union-attr]
    assert last.then.set_iter == {"page_payload": "{{ output.data.data }}"}


def check_renames_pagination_basic_set(plan: Plan) -> None:
    assert plan.steps["start"].set_ctx == {  # bare `set:` keys are ctx variables
        "current_page": "{{ workload.current_page }}",
        "page_size": "{{ workload.page_size }}",
        "collected_items": "{{ workload.collected_items }}",
        "has_more": "{{ workload.has_more }}",
    }
    assert plan.steps["check_pagination"].set_ctx["current_page"] == "{{ check_pagination.next_page }}"
    assert plan.steps["check_pagination"].tasks[0].config["input"]["current_page"] == "{{ ctx.current_page }}"
    assert arcs(plan, "check_pagination") == [
        ("fetch_page", "{{ ctx.has_more == true }}"),
        ("validate_results", "{{ ctx.has_more != true }}"),
    ]


def check_cursor_pft_flow(plan: Plan) -> None:
    cursor_steps = [name for name, step in plan.steps.items() if step.loop and step.loop.mode == "cursor"]
    assert cursor_steps == [
        f"fetch_{t}" for t in ("assessments", "conditions", "medications", "vital_signs", "demographics")
    ]
    assert all(plan.steps[name].loop.max_in_flight == 100 for name in cursor_steps)  # type: ignore[union-attr]
    batches = plan.steps["run_mds_batch_workers"]
    assert batches.loop is not None and batches.loop.max_in_flight == 5
    assert batches.tasks[0].kind == "playbook"


def check_cursor_mds_batch_worker(plan: Plan) -> None:
    assert plan.path == "tests/fixtures/playbooks/pft_flow_test/test_mds_batch_worker"
    loop = plan.steps["fetch_mds_details"].loop
    assert loop is not None and (loop.iterator, loop.max_in_flight) == ("mds_row", 5)


def check_legacy_playbook_composition(plan: Plan) -> None:
    step = plan.steps["process_users"]
    task = step.tasks[0]
    assert task.kind == "playbook" and task.config["return_step"] == "finalize_result"
    assert task.config["path"] == "tests/fixtures/playbooks/playbook_composition/user_profile_scorer"
    assert task.sink is not None and task.sink.kind == "postgres"
    assert step.loop is not None and (step.loop.iterator, step.loop.mode) == ("user", "sequential")


def check_legacy_user_profile_scorer(plan: Plan) -> None:
    assert plan.path == "tests/fixtures/playbooks/playbook_composition/user_profile_scorer"
    assert "finalize_result" in plan.steps


DETAILS: dict[str, Callable[[Plan], None]] = {
    "cursor/pft_flow.yaml": check_cursor_pft_flow,
    "cursor/mds_batch_worker.yaml": check_cursor_mds_batch_worker,
    "legacy-2025-12/playbook_composition.yaml": check_legacy_playbook_composition,
    "renames-2026-04/pagination_basic_set.yaml": check_renames_pagination_basic_set,
    "legacy-2025-12/user_profile_scorer.yaml": check_legacy_user_profile_scorer,
    "legacy-2025-12/hello_world.yaml": check_legacy_hello_world,
    "legacy-2025-12/pagination_basic.yaml": check_legacy_pagination_basic,
    "legacy-2025-12/pagination_offset.yaml": check_legacy_pagination_offset,
    "legacy-2025-12/pagination_cursor.yaml": check_legacy_pagination_cursor,
    "legacy-2025-12/pagination_retry.yaml": check_legacy_pagination_retry,
    "legacy-2025-12/pagination_max_iterations.yaml": check_legacy_max_iterations,
    "legacy-2025-12/loop_with_pagination.yaml": check_legacy_loop_with_pagination,
    "legacy-2025-12/retry_simple_config.yaml": check_legacy_retry_simple_config,
    "legacy-2025-12/retry_python_exception.yaml": check_legacy_retry_python_exception,
    "legacy-2025-12/iterator_save_test.yaml": check_legacy_iterator_save,
    "legacy-2025-12/control_flow_workbook.yaml": check_legacy_control_flow_workbook,
    "legacy-2025-12/vars_block.yaml": check_legacy_vars_block,
    "legacy-2025-12/broken_sql.yaml": check_legacy_broken_sql,
    "legacy-2025-12/v2case_pagination_retry.yaml": check_v2case_pagination_retry,
    "legacy-2025-12/v2case_loop_with_pagination.yaml": check_v2case_loop_with_pagination,
    "v10-2026-02/hello_world.yaml": check_v10_hello_world,
    "v10-2026-02/v10_canonical_example.yaml": check_v10_canonical_example,
    "v10-2026-02/pagination_basic.yaml": check_v10_pagination_basic,
    "v10-2026-02/pagination_retry.yaml": check_v10_pagination_retry,
    "v10-2026-02/loop_with_pagination.yaml": check_v10_loop_with_pagination,
    "v10-2026-02/pipeline_error_handling.yaml": check_v10_pipeline_error_handling,
    "v10-2026-02/http_pagination_jump.yaml": check_v10_http_pagination_jump,
    "v10-2026-02/iterator_save_test.yaml": check_v10_iterator_save,
    "v10-2026-02/loop_instance_isolation.yaml": check_v10_loop_instance_isolation,
    "v10-2026-02/retry_simple_config.yaml": check_v10_retry_simple_config,
    "v10-2026-02/control_flow_workbook.yaml": check_v10_control_flow_workbook,
    "cursor/pft_page_continuation.yaml": check_cursor_page_continuation,
}


# --- tool forms: duckdb, libs:, script:, secrets, verify_ssl


def check_renames_duckdb(plan: Plan) -> None:
    task = plan.steps["start"].tasks[0]
    assert (task.label, task.kind, task.config["database"]) == ("run_query", "duckdb", ":memory:")
    assert task.config["query"].startswith("CREATE TABLE users")


def check_renames_vars_simple_libs(plan: Plan) -> None:
    assert plan.steps["set_var"].tasks[0].config["libs"] == {"os": "os", "logging": "logging"}


def check_renames_script_postgres_file(plan: Plan) -> None:
    task = plan.steps["run_postgres_from_file"].tasks[0]
    assert task.config["script"] == {"uri": "{{ script_path }}", "source": {"type": "file"}}
    assert task.auth == "{{ pg_auth }}"


def check_renames_script_python_loading(plan: Plan) -> None:
    script = plan.steps["start"].tasks[0].config["script"]
    assert script == {"uri": "inline", "source": {"type": "inline", "code": "{{ test_code }}"}}


def check_renames_actions_secrets(plan: Plan) -> None:
    assert kinds(plan, "test_secrets") == [("TEST_SECRET", "secrets")]
    assert plan.steps["test_secrets"].tasks[0].config == {"provider": "env"}


def check_renames_auth0_login(plan: Plan) -> None:
    task = plan.steps["cache_and_callback"].tasks[0]
    assert (task.kind, task.auth, task.config["operation"]) == ("nats", "{{ nats_credential }}", "kv_put")
    assert task.config["value"] == "{{ prepare_session_cache.session_cache }}"
    assert plan.steps["create_user_session"].tasks[0].config["pool"] == {}


def check_legacy_ib_gateway_verify_ssl(plan: Plan) -> None:
    verify = [
        task.config.get("verify_ssl") for step in plan.steps.values() for task in step.tasks if task.kind == "http"
    ]
    assert verify and set(verify) == {False}


DETAILS.update(
    {
        "renames-2026-04/duckdb_test.yaml": check_renames_duckdb,
        "renames-2026-04/vars_simple_libs.yaml": check_renames_vars_simple_libs,
        "renames-2026-04/script_postgres_file.yaml": check_renames_script_postgres_file,
        "renames-2026-04/script_python_loading.yaml": check_renames_script_python_loading,
        "renames-2026-04/actions_secrets.yaml": check_renames_actions_secrets,
        "renames-2026-04/auth0_login_tags_credential_pool.yaml": check_renames_auth0_login,
        "legacy-2025-12/ib_gateway_verify_ssl.yaml": check_legacy_ib_gateway_verify_ssl,
    }
)


def test_every_valid_corpus_file_has_detail_checks() -> None:
    assert set(DETAILS) == set(VALID)


@pytest.mark.parametrize("name", sorted(DETAILS))
def test_normalised_details(name: str) -> None:
    DETAILS[name](plan_of(name))
