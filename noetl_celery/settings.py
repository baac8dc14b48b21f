"""The one place that reads the environment (NOETL_*), with the embedded defaults.

Unset broker and database mean the embedded default: a SQLite file under NOETL_HOME and, for
`noetl-celery run`, an in-process worker on the in-memory broker. A separate worker process
needs a real broker and says so (see `require_broker`).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from noetl_celery.errors import ConfigurationError

DEFAULT_HOME = "~/.noetl"  # where the embedded SQLite event store lives
DEFAULT_TASK_QUEUE = "noetl.tasks"  # tool calls
DEFAULT_EVENT_QUEUE = "noetl.events"  # on_event
DEFAULT_VISIBILITY_TIMEOUT = 3600  # seconds; Redis redelivers an unacked message after this
DEFAULT_MAX_COUNTDOWN = 600  # seconds; longer waits are held as a due time and re-checked
DEFAULT_RESTORE_INTERVAL = 10  # seconds between sweeps that hand out messages of dead consumers
EMBEDDED_BROKER = "memory://localhost/"


@dataclass(frozen=True)
class Settings:
    broker_url: str | None
    database_url: str
    result_backend: str | None
    home: Path
    task_queue: str
    event_queue: str
    visibility_timeout: int
    restore_interval: int
    max_countdown: int
    prefetch_multiplier: int
    task_events: bool
    event_dispatch: str  # inline: run_task calls on_event in its own job; queue: via the on_event queue

    @property
    def embedded_database(self) -> bool:
        return self.database_url.startswith("sqlite")


def _int(name: str, default: int) -> int:
    raw = os.environ.get(name)
    if raw in (None, ""):
        return default
    try:
        return int(raw)
    except ValueError as exc:
        raise ConfigurationError(f"{name} must be a whole number, got {raw!r}") from exc


def load() -> Settings:
    home = Path(os.environ.get("NOETL_HOME", DEFAULT_HOME)).expanduser()
    database_url = os.environ.get("NOETL_DATABASE_URL") or f"sqlite:///{home / 'noetl.sqlite'}"
    return Settings(
        broker_url=os.environ.get("NOETL_BROKER_URL") or None,
        database_url=database_url,
        result_backend=os.environ.get("NOETL_RESULT_BACKEND") or None,
        home=home,
        task_queue=os.environ.get("NOETL_TASK_QUEUE", DEFAULT_TASK_QUEUE),
        event_queue=os.environ.get("NOETL_EVENT_QUEUE", DEFAULT_EVENT_QUEUE),
        visibility_timeout=_int("NOETL_VISIBILITY_TIMEOUT", DEFAULT_VISIBILITY_TIMEOUT),
        restore_interval=_int("NOETL_RESTORE_INTERVAL", DEFAULT_RESTORE_INTERVAL),
        max_countdown=_int("NOETL_MAX_COUNTDOWN", DEFAULT_MAX_COUNTDOWN),
        prefetch_multiplier=_int("NOETL_PREFETCH_MULTIPLIER", 1),
        task_events=os.environ.get("NOETL_TASK_EVENTS", "1") not in ("0", "false", "no"),
        event_dispatch=_choice("NOETL_EVENT_DISPATCH", ("inline", "queue"), "inline"),
    )


def _choice(name: str, allowed: tuple[str, ...], default: str) -> str:
    value = os.environ.get(name) or default
    if value not in allowed:
        raise ConfigurationError(f"{name} must be one of {', '.join(allowed)}, got {value!r}")
    return value


def require_broker(settings: Settings) -> str:
    """The broker URL for a separate worker or `submit`; a clear error when none is set."""
    if not settings.broker_url:
        raise ConfigurationError(
            "no broker configured: set NOETL_BROKER_URL (e.g. redis://127.0.0.1:6379/0) for "
            "separate worker processes and `noetl-celery submit`; `noetl-celery run` needs none"
        )
    return settings.broker_url
