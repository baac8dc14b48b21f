"""Policy decisions and backoff, without a broker."""

from __future__ import annotations

import pytest

from noetl_celery.dsl.plan import Action, Policy, Rule
from noetl_celery.engine.decision.policy_eval import decide, next_backoff, outcome_scope

HTTP_503 = {
    "status": "error",
    "data": {
        "status_code": 503,
        "headers": {"retry-after": "7"},
        "url": "u",
        "elapsed": 0.1,
        "data": {"error": "busy"},
    },
    "error": {"kind": "server_error", "message": "HTTP 503", "retryable": True, "status": 503, "retry_after": 7.0},
    "http": {"status": 503, "headers": {"retry-after": "7"}},
}
PG_UNIQUE = {
    "status": "error",
    "error": {"kind": "sql_error", "message": "duplicate key", "code": "23505"},
    "pg": {"code": "23505"},
}
OK_PAGE = {
    "status": "ok",
    "data": {
        "status_code": 200,
        "headers": {},
        "url": "u",
        "elapsed": 0.1,
        "data": {"data": [1], "paging": {"hasMore": True, "page": 1}},
    },
    "http": {"status": 200, "headers": {}},
}


def rules(*pairs) -> Policy:
    return Policy(rules=[Rule(when=w, then=Action(do=d)) for w, d in pairs])


def verdict(policy, outcome, attempt=1):
    return decide(policy, outcome, outcome_scope(outcome, attempt))


def test_defaults_without_a_policy():
    assert verdict(None, OK_PAGE).action.do == "continue"
    assert verdict(None, HTTP_503).action.do == "fail"


def test_a_policy_with_no_matching_rule_continues():
    assert verdict(rules(("{{ outcome.http.status == 404 }}", "fail")), HTTP_503).action.do == "continue"


@pytest.mark.parametrize(
    "condition",
    [
        "{{ outcome.status == 'error' and outcome.http.status in [429, 503] }}",
        "{{ outcome.http.headers['retry-after'] == '7' }}",
        "{{ outcome.error.message == 'HTTP 503' and outcome.error.retryable }}",
        "{{ output.error.kind == 'server_error' }}",
        "{{ status_code >= 500 and error.status == 503 and not success }}",
        "{{ response.data.error == 'busy' and response.error == 'busy' }}",
        "{{ event.name == 'call.error' and attempt == 2 }}",
    ],
)
def test_conditions_see_the_outcome_under_every_name(condition):
    v = verdict(rules((condition, "retry")), HTTP_503, attempt=2)
    assert v.action.do == "retry" and v.rule == 0


def test_postgres_sqlstate_in_conditions():
    policy = rules(("{{ outcome.pg.code == '23505' }}", "continue"), (None, "fail"))
    assert verdict(policy, PG_UNIQUE).rule == 0
    assert verdict(policy, HTTP_503).rule == 1  # pg is empty on an http error, no exception


def test_missing_fields_on_success_read_as_none_and_a_broken_condition_does_not_match():
    policy = rules(
        ("{{ outcome.error.retryable and outcome.error.kind == 'x' }}", "retry"), ("{{ status_code >= 500 }}", "fail")
    )
    assert verdict(policy, OK_PAGE).action.do == "continue"
    v = verdict(policy, PG_UNIQUE)  # status_code is None: the comparison fails, the rule is skipped
    assert v.rule is None and v.skipped_conditions and "rule 1" in v.skipped_conditions[0]


def test_gated_rules():
    policy = Policy(
        rules=[
            Rule(on="ok", when="{{ response.paging.hasMore }}", then=Action(do="retry")),
            Rule(on="error", then=Action(do="retry")),
            Rule(then=Action(do="stop")),
        ]
    )
    assert verdict(policy, OK_PAGE).rule == 0
    assert verdict(policy, HTTP_503).rule == 1


@pytest.mark.parametrize(
    "action, delays",
    [
        (Action(do="retry", backoff="none", delay=2), [2, 2, 2]),
        (Action(do="retry", backoff="linear", delay=1.5), [1.5, 3.0, 4.5]),
        (Action(do="retry", backoff="exponential", delay=1), [1, 2, 4]),
        (Action(do="retry", delay=0.5, multiplier=3), [0.5, 1.5, 4.5]),
        (Action(do="retry", backoff="exponential", delay=1, max_delay=3), [1, 2, 3]),
    ],
)
def test_backoff_formulas(action, delays):
    assert [next_backoff(action, attempt) for attempt in (1, 2, 3)] == delays


def test_retry_after_is_honoured_and_jitter_stays_within_half_to_full():
    assert next_backoff(Action(do="retry", delay=1), 1, retry_after=7.0) == 7.0
    jittered = [next_backoff(Action(do="retry", backoff="exponential", delay=4, jitter=True), 2) for _ in range(50)]
    assert all(4.0 <= d <= 8.0 for d in jittered) and len(set(jittered)) > 1
