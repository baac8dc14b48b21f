"""The one place that reads the environment (NOETL_*), with the embedded defaults.

Unset broker and database mean the embedded default: a SQLite file under NOETL_HOME and, for
`noetl-celery run`, an in-process worker on the in-memory broker. A separate worker process
needs a real broker and says so (see `require_broker`).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from noetl_celery.errors import ConfigurationError

DEFAULT_HOME = "~/.noetl"  # where the embedded SQLite event store lives
DEFAULT_TASK_QUEUE = "noetl.tasks"  # tool calls
DEFAULT_EVENT_QUEUE = "noetl.events"  # on_event
DEFAULT_VISIBILITY_TIMEOUT = 3600  # seconds; Redis redelivers an unacked message after this
DEFAULT_MAX_COUNTDOWN = 600  # seconds a countdown is held by the broker; longer waits are re-checked
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


def _int(env: Mapping[str, str], name: str, default: int) -> int:
    raw = env.get(name)
    if raw in (None, ""):
        return default
    try:
        return int(raw)
    except ValueError as exc:
        raise ConfigurationError(f"{name} must be a whole number, got {raw!r}") from exc


def defaults() -> Settings:
    """The settings of an empty environment."""
    return load({})


def load(environ: Mapping[str, str] | None = None) -> Settings:
    """The settings of `environ` (the process environment by default)."""
    env = os.environ if environ is None else environ
    home = Path(env.get("NOETL_HOME", DEFAULT_HOME)).expanduser()
    visibility_timeout = _int(env, "NOETL_VISIBILITY_TIMEOUT", DEFAULT_VISIBILITY_TIMEOUT)
    # unset: at most half the visibility timeout, so a held countdown is never redelivered
    max_countdown_default = min(DEFAULT_MAX_COUNTDOWN, max(1, visibility_timeout // 2))
    database_url = env.get("NOETL_DATABASE_URL") or f"sqlite:///{home / 'noetl.sqlite'}"
    return check(Settings(
        broker_url=env.get("NOETL_BROKER_URL") or None,
        database_url=database_url,
        result_backend=env.get("NOETL_RESULT_BACKEND") or None,
        home=home,
        task_queue=env.get("NOETL_TASK_QUEUE", DEFAULT_TASK_QUEUE),
        event_queue=env.get("NOETL_EVENT_QUEUE", DEFAULT_EVENT_QUEUE),
        visibility_timeout=visibility_timeout,
        restore_interval=_int(env, "NOETL_RESTORE_INTERVAL", DEFAULT_RESTORE_INTERVAL),
        max_countdown=_int(env, "NOETL_MAX_COUNTDOWN", max_countdown_default),
        prefetch_multiplier=_int(env, "NOETL_PREFETCH_MULTIPLIER", 1),
        task_events=env.get("NOETL_TASK_EVENTS", "1") not in ("0", "false", "no"),
        event_dispatch=_choice(env, "NOETL_EVENT_DISPATCH", ("inline", "queue"), "inline"),
    ))


def _choice(env: Mapping[str, str], name: str, allowed: tuple[str, ...], default: str) -> str:
    value = env.get(name) or default
    if value not in allowed:
        raise ConfigurationError(f"{name} must be one of {', '.join(allowed)}, got {value!r}")
    return value


def check(settings: Settings) -> Settings:
    """Settings that contradict each other are refused with what to change."""
    if settings.max_countdown >= settings.visibility_timeout:
        raise ConfigurationError(
            f"NOETL_MAX_COUNTDOWN ({settings.max_countdown} s) must be shorter than NOETL_VISIBILITY_TIMEOUT "
            f"({settings.visibility_timeout} s): Redis hands a message held longer than the visibility timeout "
            "to another worker, and the retry would run more than once"
        )
    return settings


def require_broker(settings: Settings) -> str:
    """The broker URL for a separate worker or `submit`; a clear error when none is set."""
    if not settings.broker_url:
        raise ConfigurationError(
            "no broker configured: set NOETL_BROKER_URL (e.g. redis://127.0.0.1:6379/0) for "
            "separate worker processes and `noetl-celery submit`; `noetl-celery run` needs none"
        )
    return settings.broker_url
