"""The `noop` tool (also `end`, `router`, `start`): does no work, returns its args.

It is routing-only: the engine may run it inline in on_event. It must never do I/O.
"""

from __future__ import annotations

from typing import Any

from noetl_celery.tools.base import Outcome, ToolCall, register
from noetl_celery.tools.settings import ToolSettings


class NoopSettings(ToolSettings):
    args: dict[str, Any] | None = None


@register("noop", fields={"args"}, routing_only=True, aliases=("end", "router", "start"), settings=NoopSettings)
def run_noop(call: ToolCall) -> Outcome:
    """Return the task's args (None when it has none or they are empty)."""
    return Outcome.ok(call.config.get("args") or None)
