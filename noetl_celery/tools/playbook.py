"""The `playbook` tool: run another playbook as a child execution.

Its tasks never reach a worker: on_event starts the child (engine/decision/subplaybooks.py) and finishes
the task when the child ends. `run_playbook` only answers a message that reached a worker anyway.
"""

from __future__ import annotations

from noetl_celery.tools.base import Outcome, ToolCall, register

PLAYBOOK_FIELDS = {"path", "return_step", "input", "args", "timeout", "catalog_id", "version", "task"}


@register("playbook", fields=PLAYBOOK_FIELDS, required=({"path"},))
def run_playbook(call: ToolCall) -> Outcome:
    return Outcome.fail(
        "playbook", "a playbook task is started by on_event as a child execution, never run by a worker"
    )
