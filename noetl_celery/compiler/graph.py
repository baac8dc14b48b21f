"""Graph facts the engine needs from a plan: where forked branches join, and what cannot run.

A step whose arcs can fire together (inclusive mode, two or more arcs) forks; its join is the
nearest step every branch can reach. At run time a branch arriving there waits for the others.
"""

from __future__ import annotations

from collections import deque

from noetl_celery.core.errors import Problem
from noetl_celery.dsl.plan import Plan


def _distances(plan: Plan, start: str) -> dict[str, int]:
    seen = {start: 0}
    queue = deque([start])
    while queue:
        name = queue.popleft()
        for arc in plan.steps[name].next.arcs:
            if arc.step in plan.steps and arc.step not in seen:
                seen[arc.step] = seen[name] + 1
                queue.append(arc.step)
    return seen


def find_join(plan: Plan, step_name: str) -> str | None:
    step = plan.steps[step_name]
    targets = list(dict.fromkeys(arc.step for arc in step.next.arcs))
    if step.next.mode != "inclusive" or len(targets) < 2:
        return None
    reach = [_distances(plan, t) for t in targets]
    common = set(reach[0]).intersection(*reach[1:]) - {step_name}
    if not common:
        return None
    return min(common, key=lambda s: (max(r[s] for r in reach), sum(r[s] for r in reach), s))


def annotate_joins(plan: Plan) -> Plan:
    for name, step in plan.steps.items():
        step.join = find_join(plan, name)
    return plan


def unsupported(plan: Plan) -> list[Problem]:
    """Constructs that parse but that this engine does not run yet, each named (none today)."""
    del plan
    return []
