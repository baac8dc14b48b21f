"""Names the compiler gives a plan's Celery tasks (shown by `compile`, used when sending)."""

from __future__ import annotations

from noetl_celery.dsl.plan import Step, Task


def shadow_label(step: Step, task: Task) -> str:
    """How a task is named in Flower and worker logs (`#attempt<n>` is appended when sent)."""
    return step.name if task.label == step.name else f"{step.name}:{task.label}"
