"""noetl_celery: run NoETL playbooks on Celery.

Importing the package is light: the Celery app (and with it Celery, the tools and the event
store) is created on first use of `noetl_celery.app` / `noetl_celery.celery`, which is what
`celery -A noetl_celery worker` asks for. `from noetl_celery.app import app` works as before.
"""

from __future__ import annotations

from typing import Any

__all__ = ["app", "celery"]
__version__ = "0.1.0"

_APP_NAMES = ("app", "celery")  # what `celery -A noetl_celery` looks up, in this order


def __getattr__(name: str) -> Any:
    """The Celery app, created on first use. Once the module `noetl_celery.app` is imported the
    attribute `app` is that module, and Celery falls back to `celery`: both give the app."""
    if name in _APP_NAMES:
        return _celery_app()
    raise AttributeError(f"module 'noetl_celery' has no attribute {name!r}")


def _celery_app() -> Any:
    from noetl_celery.app import app as celery_app

    return celery_app
