"""Every name the engine gives its Celery tasks, spelled once: the task names, and how a task
shows in Flower and worker logs (its shadow name, args and kwargs columns).

`compile` shows these names and `publish` sends them, so what a user reads in the plan is what
Flower shows.
"""

from __future__ import annotations

from noetl_celery.dsl.plan import Step, Task

RUN_TASK = "noetl.run_task"  # one attempt of one tool call (queue NOETL_TASK_QUEUE)
ON_EVENT = "noetl.on_event"  # record an event and decide what runs next (queue NOETL_EVENT_QUEUE)


def shadow_label(step: Step, task: Task, playbook: str | None = None) -> str:
    """How a task is named in Flower and worker logs: `playbook:step` (`playbook:step:task` inside
    a pipeline). Attempt and iteration are in the args column, so the names stay few."""
    name = step.name if task.label == step.name else f"{step.name}:{task.label}"
    return f"{playbook}:{name}" if playbook else name


def attempt_shadow(label: str, attempt: int | str | None = None) -> str:
    """Flower's name of an attempt: its label alone (`playbook:step`), whatever the attempt: Flower
    keeps statistics per name, so names stay few; the attempt is in the args column."""
    return label


def event_shadow(kind: str | None) -> str:
    """Flower's name of an on_event task: `on_event:outcome`, `on_event:start`, `on_event:wake`."""
    return f"on_event:{kind}"


def attempt_argsrepr(execution_id: int, step: str, attempt: int, iteration: int | None = None, page: int = 1) -> str:
    """Flower's args column of an attempt: `execution=... step=... attempt=... iteration=... page=...`."""
    parts = [f"execution={execution_id}", f"step={step}", f"attempt={attempt}"]
    if iteration is not None:
        parts.append(f"iteration={iteration}")
    if page > 1:
        parts.append(f"page={page}")
    return " ".join(parts)


def execution_kwargsrepr(execution_id: int) -> str:
    """Flower's kwargs column of a task: only the execution id (the message is in args)."""
    return f"{{'execution_id': {execution_id}}}"
