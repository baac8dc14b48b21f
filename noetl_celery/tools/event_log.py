"""The `event_log` tool (also `log`): hands a record to the engine for the event log.

The tool itself does no I/O: it returns {"event_log": record} and the engine writes the record
to the event log. The record is the task's `args` mapping, with `message`, `status` and
`event` added when the task gives them as fields.
"""

from __future__ import annotations

from typing import Any

from noetl_celery.core.vocabulary import ToolErrorKind
from noetl_celery.tools.base import Outcome, ToolCall, register
from noetl_celery.tools.settings import ToolSettings


class EventLogSettings(ToolSettings):
    args: dict[str, Any] | None = None


@register("event_log", fields={"args", "message", "status", "event"}, aliases=("log",), settings=EventLogSettings)
def run_event_log(call: ToolCall) -> Outcome:
    """Build the record from args and the message/status/event fields."""
    args = call.config.get("args")
    if args is not None and not isinstance(args, dict):
        return Outcome.fail(
            ToolErrorKind.INVALID_ARGS, f"event_log: `args` must be a mapping, got {type(args).__name__}"
        )
    record: dict[str, Any] = dict(args or {})
    for key in ("message", "status", "event"):
        if call.config.get(key) is not None:
            record[key] = call.config[key]
    return Outcome.ok({"event_log": record})
