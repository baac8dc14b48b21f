"""The `playbook` tool: run another playbook as a child execution.

Its tasks never reach a worker: on_event starts the child (engine/decision/subplaybooks.py) and finishes
the task when the child ends. `run_playbook` only answers a message that reached a worker anyway.
"""

from __future__ import annotations

from typing import Any

from noetl_celery.core.vocabulary import ToolErrorKind
from noetl_celery.tools.base import Outcome, ToolCall, register

# `payload:` is NoETL's name for the child's workload (as `input:`/`args:` are); `retry:` is
# accepted and, as in NoETL, not used: a child execution is started once.
INPUT_KEYS = ("input", "args", "payload")
PLAYBOOK_FIELDS = {"path", "return_step", "timeout", "catalog_id", "version", "task", "retry", *INPUT_KEYS}


def child_input(config: dict[str, Any]) -> Any:
    """The child's workload overrides: the first of `input`, `args`, `payload` given."""
    for key in INPUT_KEYS:
        if config.get(key) is not None:
            return config[key]
    return None


@register("playbook", fields=PLAYBOOK_FIELDS, required=({"path"},))
def run_playbook(call: ToolCall) -> Outcome:
    return Outcome.fail(
        ToolErrorKind.PLAYBOOK, "a playbook task is started by on_event as a child execution, never run by a worker"
    )
