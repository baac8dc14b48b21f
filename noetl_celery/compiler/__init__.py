"""Playbook -> plan -> Celery signatures.

`compile_playbook` is what every entry point calls: it loads and validates the playbook in any
dialect (noetl_celery.dsl), annotates the graph (joins) and rejects what the engine cannot run,
so a bad playbook is refused before anything is enqueued. `describe` shows the plan as the
Celery task signatures the engine will send.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from noetl_celery.compiler.graph import annotate_joins, unsupported
from noetl_celery.compiler.names import shadow_label
from noetl_celery.dsl import load_plan
from noetl_celery.dsl.plan import Plan, Policy
from noetl_celery.errors import PlaybookError


def compile_playbook(source: str | Path, *, text: str | None = None,
                     overrides: dict[str, Any] | None = None) -> Plan:
    plan = load_plan(source, text=text, overrides=overrides)
    problems = unsupported(plan)
    if problems:
        raise PlaybookError(problems)
    return annotate_joins(plan)


def _policy_lines(policy: Policy | None) -> list[str]:
    if policy is None:
        return ["(default) ok -> continue; error -> fail"]
    lines = []
    for rule in policy.rules:
        gate = "" if rule.on == "any" else f"[on {rule.on}] "
        when = "else" if rule.when is None else f"when {rule.when}"
        action = rule.then.model_dump(exclude_defaults=True)
        lines.append(f"{gate}{when} -> {action}")
    return lines


def describe(plan: Plan, *, task_queue: str = "noetl.tasks", event_queue: str = "noetl.events") -> dict[str, Any]:
    """The plan as signatures: per step, the run_task signature of each task, its policy, routing."""
    steps = []
    for name, step in plan.steps.items():
        tasks = []
        for task in step.tasks:
            tasks.append({
                "label": task.label,
                "kind": task.kind,
                "signature": {"task": "noetl.run_task", "queue": task_queue,
                              "shadow": f"{shadow_label(step, task)}#attempt<n>",
                              "kwargs": {"execution_id": "<execution_id>",
                                         "message": {"step": name, "task_index": len(tasks)}}},
                "policy": _policy_lines(task.policy),
                "sink": task.sink.kind if task.sink else None,
            })
        steps.append({
            "step": name,
            "tasks": tasks or "routing only (decided inside on_event)",
            "loop": step.loop.model_dump(exclude_defaults=True) if step.loop else None,
            "next": {"mode": step.next.mode,
                     "arcs": [{"step": a.step, "when": a.when, "negate": a.negate or None} for a in step.next.arcs]},
            "join": step.join,
        })
    return {
        "playbook": plan.name,
        "dialect": plan.dialect,
        "api_version": plan.api_version,
        "entry_step": plan.entry_step,
        "final_step": plan.final_step,
        "on_event": {"task": "noetl.on_event", "queue": event_queue},
        "steps": steps,
    }
