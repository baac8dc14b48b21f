"""The Celery app the transport works with, bound once by `noetl_celery.app`.

The app module creates the Celery app, configures it and declares the task shims; it binds them
here (`bind`), so the transport publishes, decides and sweeps without importing the app module
back. A process uses the transport after importing `noetl_celery.app` (a worker, through
`celery -A noetl_celery`; the runner's functions import it before they publish). Each look-up
is made on use: a test that replaces the app module's `current_settings` is heard.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from noetl_celery.config.settings import Settings


@dataclass(frozen=True)
class Binding:
    """The Celery app, its tasks by role, and where the current settings come from."""

    app: Any
    run_task: Any
    on_event: Any
    notify: Any
    settings: Callable[[], Settings]


_binding: Binding | None = None


def bind(app: Any, *, run_task: Any, on_event: Any, notify: Any, settings: Callable[[], Settings]) -> None:
    """Bind the Celery app and its tasks (at the app module's import)."""
    global _binding
    _binding = Binding(app=app, run_task=run_task, on_event=on_event, notify=notify, settings=settings)


class Unbound(RuntimeError):
    """The transport was used in a process that did not import `noetl_celery.app`."""


def binding() -> Binding:
    """The bound app (importing `noetl_celery.app` binds it)."""
    if _binding is None:
        raise Unbound("the Celery app is not bound to the transport: import noetl_celery.app first")
    return _binding


def celery_app() -> Any:
    return binding().app


def current_settings() -> Settings:
    """This process's settings (the app's configuration; a bad environment raises its error)."""
    return binding().settings()
