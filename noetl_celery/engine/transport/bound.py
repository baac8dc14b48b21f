"""The Celery app the transport works with, bound once by `noetl_celery.app`.

The app module creates the Celery app, configures it and declares the task shims; it binds them
here (`bind`), so the transport publishes, decides and sweeps without importing the app module
back. Each look-up is made on use: a test that rebinds (or replaces the app module's
`current_settings`) is heard.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from noetl_celery.settings import Settings


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


def binding() -> Binding:
    """The bound app; importing `noetl_celery.app` binds it."""
    if _binding is None:
        import importlib

        importlib.import_module("noetl_celery.app")  # binds; the transport never names it in an import
    assert _binding is not None
    return _binding


def celery_app() -> Any:
    return binding().app


def current_settings() -> Settings:
    """This process's settings (the app's configuration; a bad environment raises its error)."""
    return binding().settings()
