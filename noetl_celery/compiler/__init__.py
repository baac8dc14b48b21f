"""Playbook -> plan -> Celery signatures.

`compile_playbook` is what every entry point calls: it loads and validates the playbook in any
dialect (noetl_celery.dsl), annotates the graph (joins) and rejects what the engine cannot run,
so a bad playbook is refused before anything is enqueued. `describe` shows the plan as the
Celery task signatures the engine will send.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from noetl_celery.compiler import resolve
from noetl_celery.compiler.graph import annotate_joins, unsupported
from noetl_celery.compiler.names import ON_EVENT, RUN_TASK, shadow_label
from noetl_celery.core.errors import PlaybookError, Problem
from noetl_celery.dsl import load_plan
from noetl_celery.dsl.plan import Plan, Policy

PLAYBOOK_KIND = "playbook"


def compile_playbook(
    source: str | Path,
    *,
    text: str | None = None,
    overrides: dict[str, Any] | None = None,
    catalog: resolve.Catalog | None = None,
    seen: frozenset[str] = frozenset(),
    warnings: list[Problem] | None = None,
) -> Plan:
    """Load, validate and annotate a playbook. Sub-playbooks named by a static path are resolved
    and compiled too (a missing or invalid child is a problem at the parent task's line);
    templated paths are resolved when the task runs. `warnings`: see dsl.load_plan."""
    plan = load_plan(source, text=text, overrides=overrides, warnings=warnings)
    problems = unsupported(plan) + child_problems(plan, catalog, seen | {plan.path or str(source)})
    if problems:
        raise PlaybookError(problems)
    return annotate_joins(plan)


def compile_source(
    path: str,
    overrides: dict[str, Any] | None = None,
    catalog: resolve.Catalog | None = None,
    warnings: list[Problem] | None = None,
) -> Plan:
    """The plan of a playbook file, or of the catalog path of a registered playbook when no such
    file exists (`noetl-celery register`). `catalog`: the lookup (children are found in it too);
    `warnings`: see dsl.load_plan."""
    if catalog is not None and not Path(path).exists():
        found = catalog(path)
        if found is not None:
            return compile_playbook(
                found.source, text=found.text, overrides=overrides, catalog=catalog, warnings=warnings
            )
    return compile_playbook(path, overrides=overrides, catalog=catalog, warnings=warnings)


def child_problems(plan: Plan, catalog: resolve.Catalog | None, seen: frozenset[str]) -> list[Problem]:
    problems = []
    file = plan.source_file or plan.name
    for name, step in plan.steps.items():
        for task in step.tasks:
            path = task.config.get("path")
            if task.kind != PLAYBOOK_KIND or not isinstance(path, str) or resolve.is_template(path):
                continue
            where = f"{name}.tool.path" if len(step.tasks) == 1 else f"{name}.tool.{task.label}.path"
            try:
                found = resolve.find(path, plan.source_file, catalog)
            except PlaybookError as exc:
                first = exc.problems[0] if exc.problems else None
                problems.append(Problem(file, task.line, where, f"sub-playbook {path!r} cannot be read: {first}"))
                continue
            if found is None:
                problems.append(
                    Problem(file, task.line, where, resolve.not_found_message(path, plan.source_file, catalog))
                )
                continue
            if path in seen:
                continue  # a playbook that calls itself: the nesting limit stops it at run time
            try:
                compile_playbook(found.source, text=found.text, catalog=catalog, seen=seen | {path})
            except PlaybookError as exc:
                first = exc.problems[0] if exc.problems else None
                problems.append(Problem(file, task.line, where, f"sub-playbook {path!r} is invalid: {first}"))
    return problems


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
        tasks: list[dict[str, Any]] = []
        for task in step.tasks:
            tasks.append(
                {
                    "label": task.label,
                    "kind": task.kind,
                    "signature": {
                        "task": RUN_TASK,
                        "queue": task_queue,
                        "shadow": shadow_label(step, task, plan.name),
                        "kwargs": {
                            "execution_id": "<execution_id>",
                            "message": {"step": name, "task_index": len(tasks)},
                        },
                    },
                    "policy": _policy_lines(task.policy),
                    "sink": task.sink.kind if task.sink else None,
                }
            )
        steps.append(
            {
                "step": name,
                "tasks": tasks or "routing only (decided inside on_event)",
                "loop": step.loop.model_dump(exclude_defaults=True) if step.loop else None,
                "next": {
                    "mode": step.next.mode,
                    "arcs": [
                        {"step": a.step, "when": a.when, "negate": a.negate or None, "fallback": a.fallback or None}
                        for a in step.next.arcs
                    ],
                },
                "join": step.join,
                "tags": step.tags,
                "result": (
                    {"select": step.result_select, "advisory": step.result_hints or None}
                    if step.result_select or step.result_hints
                    else None
                ),
            }
        )
    return {
        "playbook": plan.name,
        "dialect": plan.dialect,
        "api_version": plan.api_version,
        "entry_step": plan.entry_step,
        "final_step": plan.final_step,
        "tags": plan.tags,
        "on_event": {"task": ON_EVENT, "queue": event_queue},
        "steps": steps,
    }
