"""How log lines look (NOETL_LOG_FORMAT) and which attempt each line belongs to.

Decides:
- an attempt's fields (`execution_id`, `step`, `attempt`, `iteration`, `worker`) are held for the
  attempt's duration (`attempt_scope`, a context variable of the thread running it) and added to
  every record logged meanwhile by any logger, the playbook's own `logging` included
  (`AttemptFields`, a filter on the handlers);
- `text` (the default): the lines as before, with ` [execution=… step=… attempt=… iteration=…]`
  after a record logged inside an attempt that does not name its execution already;
  `json`: one JSON object a line (structlog's renderer): `timestamp` (ISO 8601, UTC), `level`,
  `logger`, `message`, the attempt's fields, `exception` (a traceback, as text) when there is one;
- a worker, beat (Celery configures their handlers: `install` restyles them) and the server (no
  handler of its own: `configure_process` adds one on stderr, with timestamps, its access log
  included) use the same formats; the CLI's own output is not logging and is unchanged, and its
  warnings are JSON lines with NOETL_LOG_FORMAT=json.
- what an attempt writes to file descriptors 1 and 2 itself reaches the log through fd_masking's
  pipes; with `json` each such line is wrapped (`json_line`) with the fields of the attempt that
  was running when it was read, logger `stdout`/`stderr`.
Secrets stay masked: the masking filter runs on each handler before its formatter, and the
wrapped lines are masked before they are wrapped.
"""

from __future__ import annotations

import contextlib
import contextvars
import json
import logging
import sys
import time
from collections.abc import Iterator, MutableMapping
from typing import Any

ATTEMPT_FIELDS = ("execution_id", "step", "attempt", "iteration", "worker")
FORMATS = ("text", "json")
SERVER_LEVEL = logging.INFO  # the server's lines: its access log is INFO
CLI_LEVEL = logging.WARNING  # a command's: warnings and errors only, as without a handler

_attempt: contextvars.ContextVar[dict[str, Any] | None] = contextvars.ContextVar("noetl_attempt", default=None)
_last_entered: dict[str, Any] = {"fields": None}  # the attempt a thread entered last (fd_masking's pump reads it)
_format: dict[str, str] = {"name": "text"}


@contextlib.contextmanager
def attempt_scope(**fields: Any) -> Iterator[None]:
    """Records logged inside the block carry `fields` (see the module docstring)."""
    token = _attempt.set(fields)
    _last_entered["fields"] = fields
    try:
        yield
    finally:
        _attempt.reset(token)
        if _last_entered["fields"] is fields:
            _last_entered["fields"] = None


def current() -> dict[str, Any] | None:
    return _attempt.get()


def last_entered() -> dict[str, Any] | None:
    return _last_entered["fields"]


def format_name() -> str:
    return _format["name"]


class AttemptFields(logging.Filter):
    """Puts the running attempt's fields on each record (None outside an attempt)."""

    def filter(self, record: logging.LogRecord) -> bool:
        fields = _attempt.get()
        if fields is not None and getattr(record, "noetl_attempt", None) is None:
            record.noetl_attempt = fields
            for name in ATTEMPT_FIELDS:
                setattr(record, name, fields.get(name))
        return True


_FIELDS_FILTER = AttemptFields()


class TextFormatter(logging.Formatter):
    """Another formatter's line, with the attempt's fields after it (when it does not name them)."""

    def __init__(self, inner: logging.Formatter | None):
        super().__init__()
        self.inner = inner or logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s")

    def format(self, record: logging.LogRecord) -> str:
        line = self.inner.format(record)
        fields = getattr(record, "noetl_attempt", None)
        if not fields or f"execution={fields.get('execution_id')}" in line:
            return line
        shown = " ".join(
            f"{k}={fields[k]}" for k in ("execution_id", "step", "attempt", "iteration") if fields.get(k) is not None
        )
        return f"{line} [{shown.replace('execution_id=', 'execution=')}]"


def json_formatter() -> logging.Formatter:
    """structlog's JSON renderer over standard logging records (see the module docstring)."""
    import structlog

    def attempt_fields(_: Any, __: str, event: MutableMapping[str, Any]) -> MutableMapping[str, Any]:
        record = event.get("_record")
        fields = getattr(record, "noetl_attempt", None) or {}
        for name in ATTEMPT_FIELDS:
            if fields.get(name) is not None:
                event[name] = fields[name]
        return event

    def message_key(_: Any, __: str, event: MutableMapping[str, Any]) -> MutableMapping[str, Any]:
        event["message"] = event.pop("event", "")
        return event

    return structlog.stdlib.ProcessorFormatter(
        foreign_pre_chain=[
            structlog.stdlib.add_log_level,
            structlog.stdlib.add_logger_name,
            structlog.processors.TimeStamper(fmt="iso", utc=True, key="timestamp"),
        ],
        processors=[
            attempt_fields,
            structlog.stdlib.ProcessorFormatter.remove_processors_meta,
            structlog.processors.format_exc_info,
            message_key,
            structlog.processors.JSONRenderer(sort_keys=False, default=str),
        ],
    )


def install(logger: logging.Logger | None, name: str) -> None:
    """Restyle the handlers of `logger` and of the root logger (Celery's, set up by the worker or
    beat) in format `name`, with the attempt's fields. Idempotent."""
    _format["name"] = name
    for target in {id(x): x for x in (logging.getLogger(), logger) if x is not None}.values():
        for handler in target.handlers:
            _restyle(handler, name)


def _restyle(handler: logging.Handler, name: str) -> None:
    if _FIELDS_FILTER not in handler.filters:
        handler.addFilter(_FIELDS_FILTER)
    current_formatter = handler.formatter
    if name == "json":
        if not isinstance(current_formatter, _json_types()):
            handler.setFormatter(json_formatter())
    elif _celerys(current_formatter):  # a handler someone else set up (a test's capture) keeps its lines
        handler.setFormatter(TextFormatter(current_formatter))


def _celerys(formatter: logging.Formatter | None) -> bool:
    """Whether `formatter` is Celery's (its ColorFormatter, worker and beat), told by its module: the
    tools reach this module (fd_masking) and must not import Celery."""
    return any(kind.__module__ == "celery.utils.log" for kind in type(formatter).__mro__)


def _json_types() -> tuple[type, ...]:
    import structlog

    return (structlog.stdlib.ProcessorFormatter,)


def configure_process(name: str, level: int) -> logging.Handler | None:
    """A process that set up no logging (the CLI, the server): one handler on stderr at `level`
    (timestamps in both formats), masked, with the attempt's fields; where Celery's handlers are
    the root's already (an embedded worker), those are restyled instead. Returns its own handler."""
    from noetl_celery.config import secret_registry

    root = logging.getLogger()
    handler = _own_handler["handler"]
    if not [other for other in root.handlers if other is not handler]:  # else Celery's (an embedded worker's)
        if handler is None:
            handler = _own_handler["handler"] = logging.StreamHandler(sys.stderr)
            handler.setFormatter(json_formatter() if name == "json" else logging.Formatter(TEXT_FORMAT))
            handler.setLevel(level)
        handler.setLevel(min(handler.level, level))
        if handler not in root.handlers:
            root.addHandler(handler)
    root.setLevel(min(root.getEffectiveLevel(), level))
    install(None, name)
    secret_registry.install_log_filter()
    return handler


_own_handler: dict[str, logging.Handler | None] = {"handler": None}


TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


def json_line(text: str, stream: str) -> str:
    """One line an attempt wrote to fd 1 or 2 (masked already), as a JSON log line."""
    event: dict[str, Any] = {
        "timestamp": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime()) + f".{int(time.time() * 1e6) % 1_000_000:06d}Z",
        "level": "info" if stream == "stdout" else "warning",
        "logger": stream,
        "message": text,
    }
    fields = last_entered() or {}
    event.update({k: fields[k] for k in ATTEMPT_FIELDS if fields.get(k) is not None})
    return json.dumps(event, default=str)
