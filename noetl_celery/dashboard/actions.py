"""The control actions the dashboard offers (cancel, resume): the engine's own commands, called
as `noetl-celery cancel` / `resume` call them. Each is offered only where it exists in
noetl_celery.runner, and only behind the dashboard token (handlers.Control).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from noetl_celery.config import settings as noetl_settings

CANCEL_REASON = "cancelled from the dashboard"  # recorded in the execution.cancelled row

Action = Callable[[noetl_settings.Settings, int], Any]


def _cancel(settings: noetl_settings.Settings, execution_id: int) -> Any:
    from noetl_celery import runner

    return runner.cancel(settings.database_url, execution_id, CANCEL_REASON)


def _resume(settings: noetl_settings.Settings, execution_id: int) -> Any:
    from noetl_celery import runner

    noetl_settings.require_broker(settings)  # resuming publishes the attempts to run again
    return runner.resume(settings, execution_id)


def available() -> dict[str, Action]:
    from noetl_celery import runner

    found: dict[str, Action] = {}
    if callable(getattr(runner, "cancel", None)):
        found["cancel"] = _cancel
    if callable(getattr(runner, "resume", None)):
        found["resume"] = _resume
    return found
