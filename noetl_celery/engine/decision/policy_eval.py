"""Retry policy: which rule an attempt's outcome matches, and how long to wait before the next try.

Defaults (canonical DSL): no policy -> an ok outcome continues, an error fails. A policy with no
matching rule -> continue. A condition that cannot be evaluated (e.g. `status_code >= 500` when
there is no status code) does not match; the reason is kept for the event row.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from noetl_celery.core.errors import TemplateError
from noetl_celery.dsl.plan import DEFAULT_PAGINATION_MAX, DEFAULT_RETRY_ATTEMPTS, Action, Policy
from noetl_celery.templates.render import Lenient, as_step_result, evaluate_condition, response_view

if TYPE_CHECKING:
    from noetl_celery.engine.decision.inputs import Draws


class EventName(str):
    """`event.name` of a step's terminal event; equal to each of its aliases (`call.done`,
    `step.exit`, `loop.done`, ...), so legacy `case:` and canonical arcs both match."""

    aliases: frozenset[str]

    def __new__(cls, name: str, aliases: tuple[str, ...] = ()) -> EventName:
        obj = super().__new__(cls, name)
        obj.aliases = frozenset((name, *aliases))
        return obj

    def __eq__(self, other: object) -> bool:
        return other in self.aliases if isinstance(other, str) else NotImplemented

    def __ne__(self, other: object) -> bool:
        result = self.__eq__(other)
        return result if result is NotImplemented else not result

    __hash__ = str.__hash__


@dataclass
class Verdict:
    action: Action
    rule: int | None  # index of the matched rule; None = the default
    skipped_conditions: list[str]


DEFAULT_ATTEMPTS = DEFAULT_RETRY_ATTEMPTS
DEFAULT_PAGES = DEFAULT_PAGINATION_MAX
DEFAULT_OK = Action(do="continue")
DEFAULT_ERROR = Action(do="fail")


def outcome_scope(outcome: dict[str, Any], attempt: int) -> dict[str, Any]:
    """The names a policy condition sees: `outcome`/`output`, and the legacy flat names."""
    status = outcome.get("status")
    data = outcome.get("data")
    error = Lenient(outcome.get("error") or {})
    http = Lenient(outcome.get("http") or {})
    pg = Lenient(outcome.get("pg") or {})
    view = Lenient(status=status, data=data, result=data, error=error, http=http, pg=pg)
    if http.get("status") is not None and "status" not in error and status == "error":
        error["status"] = http["status"]
    return {
        "outcome": view,
        "output": view,
        "result": as_step_result(data),  # answers .result/.data whatever its type, as a step's result does
        "data": data,
        "response": response_view(data),
        "error": error if status == "error" else None,
        "status_code": http.get("status"),
        "success": status == "ok",
        "attempt": attempt,
        "_attempt": attempt,
        "event": {"name": EventName("call.done" if status == "ok" else "call.error")},
    }


def decide(policy: Policy | None, outcome: dict[str, Any], context: dict[str, Any]) -> Verdict:
    ok = outcome.get("status") == "ok"
    if policy is None or not policy.rules:
        return Verdict(DEFAULT_OK if ok else DEFAULT_ERROR, None, [])
    skipped: list[str] = []
    for index, rule in enumerate(policy.rules):
        if rule.on == "ok" and not ok or rule.on == "error" and ok:
            continue
        try:
            matched = evaluate_condition(rule.when, context)
        except TemplateError as exc:
            skipped.append(f"rule {index}: {exc}")
            continue
        if matched:
            return Verdict(rule.then, index, skipped)
    return Verdict(DEFAULT_OK, None, skipped)


def next_backoff(action: Action, attempt: int, retry_after: float | None = None) -> float:
    """Seconds to wait after attempt number `attempt` failed, before attempt + 1."""
    base = max(action.delay, 0.0)
    if action.multiplier:
        delay = base * action.multiplier ** (attempt - 1)
    elif action.backoff == "linear":
        delay = base * attempt
    elif action.backoff == "exponential":
        delay = base * 2 ** (attempt - 1)
    else:
        delay = base
    if retry_after:
        delay = max(delay, float(retry_after))
    delay = min(delay, action.max_delay)
    if action.jitter and delay > 0:
        delay = _jitter(delay / 2, delay)
    return round(delay, 3)


# the draws of the decision being made (its inputs' `draws`, inputs.py); none: new random ones
_DRAWS: ContextVar[Draws | None] = ContextVar("noetl_decision_draws", default=None)


def _jitter(low: float, high: float) -> float:
    """A random delay in [low, high], drawn from the decision's inputs (`drawing`)."""
    draws = _DRAWS.get()
    return draws.uniform(low, high) if draws is not None else random.uniform(low, high)


@contextmanager
def drawing(draws: Draws) -> Iterator[None]:
    """Within: a jittered backoff is drawn from `draws` (a decision's inputs: new random draws,
    or the ones a recorded decision drew, `inputs.RecordedDraws`)."""
    token = _DRAWS.set(draws)
    try:
        yield
    finally:
        _DRAWS.reset(token)
