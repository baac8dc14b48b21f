"""Pagination: gathering the pages of one paginated task into the step's (or iteration's) result.

Each page is its own Celery task and its own `page.completed` row (with the page's data). When
the last page arrives, the pages are read back from those rows, in order, and collected by the
rule's `collect` strategy: the event log is the source of truth, no page list rides in messages.
"""

from __future__ import annotations

import re
from typing import Any

from noetl_celery.core import vocabulary as ev
from noetl_celery.dsl.plan import Collect, Task
from noetl_celery.engine.decision.reads import Reads
from noetl_celery.engine.messages import TaskMessage

_SEQ = re.compile(r"\.s(\d+)\.a\d+\.done$")
_MISSING = object()


def collect_spec(task: Task) -> Collect:
    if task.policy:
        for rule in task.policy.rules:
            if rule.then.collect is not None:
                return rule.then.collect
    return Collect()


def response_body(data: Any) -> Any:
    """The body of an HTTP result ({status_code, ..., data: body}); other results as they are."""
    if isinstance(data, dict) and "status_code" in data and "data" in data:
        return data["data"]
    return data


def _walk(value: Any, path: list[str]) -> Any:
    for part in path:
        if isinstance(value, dict) and part in value:
            value = value[part]
        elif isinstance(value, list) and part.isdigit() and int(part) < len(value):
            value = value[int(part)]
        else:
            return _MISSING
    return value


def extract(data: Any, path: str | None) -> Any:
    """The part of one page to collect: `path` read in the response body, else in the whole result."""
    if not path:
        return response_body(data)
    parts = path.split(".")
    for base in (response_body(data), data):
        found = _walk(base, parts)
        if found is not _MISSING:
            return found
    return None


def combine(pieces: list[Any], strategy: str) -> Any:
    if strategy == "replace":
        return pieces[-1] if pieces else None
    if strategy == "merge":
        merged: dict[str, Any] = {}
        for piece in pieces:
            if isinstance(piece, dict):
                merged.update(piece)
        return merged
    if strategy == "collect":
        return list(pieces)
    out: list[Any] = []
    for piece in pieces:
        if isinstance(piece, list):
            out.extend(piece)
        elif piece is not None:
            out.append(piece)
    return out


def collect_pages(reads: Reads, message: TaskMessage, task: Task, last: Any) -> Any:
    """All pages of the sequence ending with `message` (whose data is `last`), collected."""
    first_seq = message.seq - (message.page - 1)
    pages: dict[int, Any] = {}
    for row in reads.run_events(message.run_id, ev.PAGE_COMPLETED, ("iteration", "task", "event_id", "result")):
        if row["iteration"] != message.iteration or row["task"] != task.label:
            continue
        match = _SEQ.search(row["event_id"])
        if match and first_seq <= int(match.group(1)) < message.seq:
            pages[int(match.group(1))] = row["result"]
    ordered = [pages[s] for s in sorted(pages)] + [last]
    spec = collect_spec(task)
    return combine([extract(page, spec.path) for page in ordered], spec.strategy)
