"""Routing: which arcs of a finished step fire, and whether a step is admitted.

Pure functions over the plan and a render context; the orchestrator records what they decide.
"""

from __future__ import annotations

from typing import Any

from noetl_celery.core.errors import TemplateError
from noetl_celery.dsl.plan import Arc, Rule, Step
from noetl_celery.engine.decision.policy_eval import EventName
from noetl_celery.templates.budget import BudgetExceeded
from noetl_celery.templates.render import evaluate_condition, lenient_active, note, plain, render_value

# What `event.name` equals when a step's arcs are evaluated, by how the step ended.
TERMINAL_EVENT_NAMES = {
    "call": EventName("call.done", ("step.exit", "step.done", "step.completed", "action.completed")),
    "loop": EventName("loop.done", ("step.exit", "step.done", "step.completed", "iterator.completed")),
}


def fired_arcs(step: Step, context: dict[str, Any]) -> list[Arc]:
    """The arcs that fire: exclusive mode takes the first that holds, inclusive takes all."""
    arcs = [arc for arc in step.next.arcs if not arc.fallback]
    fired = _fired(arcs, step.next.mode, context)
    fallback = [arc for arc in step.next.arcs if arc.fallback]
    if not fired and fallback:  # v2 `case:` beside `next:`: next routes when no case entry did
        fired = _fired(fallback, step.next.fallback_mode, context)
    return fired


def _fired(arcs: list[Arc], mode: str, context: dict[str, Any]) -> list[Arc]:
    fired: list[Arc] = []
    for arc in arcs:
        holds = _holds(arc, context)
        if arc.negate:
            holds = not holds
        if holds:
            fired.append(arc)
            if mode == "exclusive":
                break
    return fired


def _holds(arc: Arc, context: dict[str, Any]) -> bool:
    """An arc's `when`; rendering leniently (templates.render.lenient), a `when` that raises is false,
    as in NoETL (the next arc is tried), and noted. A template past its budget still fails."""
    try:
        return evaluate_condition(arc.when, context)
    except BudgetExceeded:
        raise
    except TemplateError as exc:
        if not lenient_active():
            raise
        note(f"the when of the arc to {arc.step!r} raised, read as false: {exc}")
        return False


def arc_args(arc: Arc, context: dict[str, Any]) -> dict[str, Any]:
    return plain(render_value(arc.args, context)) if arc.args else {}


def admitted(rules: list[Rule] | None, context: dict[str, Any]) -> bool:
    """Admission rules: the first that holds decides; `continue` admits. No rules: admitted."""
    if not rules:
        return True
    for rule in rules:
        if evaluate_condition(rule.when, context):
            return rule.then.do == "continue"
    return False
