"""The limits that bound hostile or oversized input and output, and the truncation marker.

Decides how big a playbook, a template's work and a stored result may be, and what stands in for
a value that is too big to store: a marker with its full size, its SHA-256 and a short preview.

Each limit is read from its environment variable when used, through `settings.limit` (so a worker
and the CLI agree, and `noetl-celery config` shows them with the other settings):
- NOETL_MAX_RESULT_BYTES: a result, error or body stored in an event row or sent in a message
  (JSON size, default 1 MB);
- NOETL_MAX_PLAYBOOK_BYTES: a playbook file (default 4 MB);
- NOETL_MAX_YAML_NODES: YAML nodes built, aliases counted each time they are used (default 500000);
- NOETL_MAX_INPUT_DEPTH: nesting levels of a playbook's YAML, of a JSON request body and of a
  workload (default 100; deeper input is refused with its line, never parsed recursively);
- NOETL_TEMPLATE_TIMEOUT: seconds one template evaluation may take (default 5);
- NOETL_TEMPLATE_MAX_BYTES: size of a string, list or number one template operation may build
  (default 1 MB);
- NOETL_MAX_LOOP_ITEMS: elements of a loop's rendered collection (default 100000; a cursor loop
  has no such bound);
- NOETL_MAX_RESULT_DEPTH: nesting levels of a result (default 200; see `result_depth`).
- NOETL_MAX_STEPS: step runs one execution may start (default 100000; engine/decision/orchestrator.py).
- NOETL_MAX_STORED_BYTES: a result above NOETL_MAX_RESULT_BYTES is stored once outside its event
  row (store/blobs.py) and the row holds its reference (`reference`); above this limit (JSON
  size, default 256 MB) it is truncated instead (a marker), and cannot be read back.
- NOETL_STORED_CACHE_BYTES: values stored by reference one process keeps decoded, least recently
  used dropped first (JSON size of the values, default 64 MB).
- NOETL_LOOP_PAGE_BYTES: a loop collection above NOETL_MAX_RESULT_BYTES is stored in pages of about
  this much JSON (default 256 kB), read one at a time (store/blobs.py `collection_form`).
- NOETL_STORE_PIECE_BYTES: a value stored by reference whose stored bytes are above this (default
  256 KiB) goes to PostgreSQL by COPY, written as it is sent, and a loop's stored source is read
  this many bytes at a time (store/blobs.py `_insert_copied`, `_stored_pieces`).
"""

from __future__ import annotations

import hashlib
import json
import sys
from typing import Any

from noetl_celery.config import settings

DEFAULT_MAX_RESULT_BYTES = settings.DEFAULT_MAX_RESULT_BYTES  # bytes of JSON per stored result / error / body
DEFAULT_MAX_PLAYBOOK_BYTES = settings.DEFAULT_MAX_PLAYBOOK_BYTES  # bytes of playbook text
DEFAULT_MAX_YAML_NODES = settings.DEFAULT_MAX_YAML_NODES  # YAML nodes built, aliases expanded
DEFAULT_TEMPLATE_TIMEOUT = settings.DEFAULT_TEMPLATE_TIMEOUT  # seconds per template evaluation
DEFAULT_TEMPLATE_MAX_BYTES = settings.DEFAULT_TEMPLATE_MAX_BYTES  # bytes one template operation may build
PREVIEW_CHARS = 1000  # characters of a truncated value kept in its marker
TRUNCATED = "__truncated__"  # the key that marks a truncated value
STORED = "__stored__"  # the key that marks a reference to a value stored outside its row
PAGED = "__paged__"  # the key that marks a loop collection stored in pages (store/blobs.py collection_form)


def max_result_bytes() -> int:
    return int(settings.limit(settings.MAX_RESULT_BYTES_ENV))


def max_playbook_bytes() -> int:
    return int(settings.limit(settings.MAX_PLAYBOOK_BYTES_ENV))


def max_yaml_nodes() -> int:
    return int(settings.limit(settings.MAX_YAML_NODES_ENV))


def max_input_depth() -> int:
    return int(settings.limit(settings.MAX_INPUT_DEPTH_ENV))


def template_timeout() -> float:
    return settings.limit(settings.TEMPLATE_TIMEOUT_ENV)


def template_max_bytes() -> int:
    return int(settings.limit(settings.TEMPLATE_MAX_BYTES_ENV))


def max_loop_items() -> int:
    return int(settings.limit(settings.MAX_LOOP_ITEMS_ENV))


RECURSION_PER_LEVEL = 4  # Python frames one nesting level may take (conversion, masking, JSON)
RECURSION_HEADROOM = 1000  # frames of the worker's own stack beside them


def max_result_depth() -> int:
    """NOETL_MAX_RESULT_DEPTH, with this process's recursion limit raised to fit: results are
    converted, masked and encoded by recursive code, about RECURSION_PER_LEVEL frames a level."""
    depth = int(settings.limit(settings.MAX_RESULT_DEPTH_ENV))
    needed = depth * RECURSION_PER_LEVEL + RECURSION_HEADROOM
    if sys.getrecursionlimit() < needed:
        sys.setrecursionlimit(needed)
    return depth


def max_stored_bytes() -> int:
    return int(settings.limit(settings.MAX_STORED_BYTES_ENV))


def stored_cache_bytes() -> int:
    return int(settings.limit(settings.STORED_CACHE_BYTES_ENV))


def loop_page_bytes() -> int:
    return int(settings.limit(settings.LOOP_PAGE_BYTES_ENV))


def store_piece_bytes() -> int:
    return int(settings.limit(settings.STORE_PIECE_BYTES_ENV))


def max_steps() -> int:
    return int(settings.limit(settings.MAX_STEPS_ENV))


def marker(size: int, sha256: str, preview: str, limit: int) -> dict[str, Any]:
    """What is stored instead of a value of `size` bytes over `limit`."""
    return {
        TRUNCATED: True,
        "size": size,
        "sha256": sha256,
        "limit": limit,
        "preview": preview[:PREVIEW_CHARS],
        "message": f"value of {size} bytes truncated (limit {limit} bytes, NOETL_MAX_RESULT_BYTES); "
        "move big data through a sink",
    }


def reference(execution_id: int, size: int, sha256: str, value: Any, text: str) -> dict[str, Any]:
    """What an event row (or a variable, a loop's collection) holds instead of a value of `size`
    bytes of JSON stored outside it (store/blobs.py), under (execution_id, sha256). Templates read
    the whole value through it (templates.render: `materialise`); it is never taken for the value."""
    ref: dict[str, Any] = {
        STORED: True,
        "execution_id": execution_id,
        "sha256": sha256,
        "size": size,
        "type": type(value).__name__,
        "preview": text[: PREVIEW_CHARS // 5],
        "message": f"value of {size} bytes stored by reference (above NOETL_MAX_RESULT_BYTES); "
        "templates read the whole value",
    }
    if isinstance(value, (list, dict)):
        ref["length"] = len(value)
    return ref


def is_reference(value: Any) -> bool:
    """A reference to a value stored outside its row (`reference`), whatever mapping holds it."""
    return isinstance(value, dict) and value.get(STORED) is True and isinstance(value.get("sha256"), str)


def is_paged(value: Any) -> bool:
    """A loop collection kept in pages stored by reference (store/blobs.py `collection_form`)."""
    return isinstance(value, dict) and value.get(PAGED) is True and isinstance(value.get("pages"), list)


def is_truncated(value: Any) -> bool:
    return isinstance(value, dict) and value.get(TRUNCATED) is True


def cap(value: Any, limit: int | None = None) -> Any:
    """`value` itself when its JSON is at most `limit` bytes, else its truncation marker."""
    limit = max_result_bytes() if limit is None else limit
    if value is None or isinstance(value, (bool, int, float)) or is_truncated(value) or is_reference(value):
        return value
    if isinstance(value, str) and len(value) * 4 <= limit:  # UTF-8 needs at most 4 bytes a character
        return value
    text = json.dumps(value, default=str, ensure_ascii=False)
    raw = text.encode("utf-8")
    if len(raw) <= limit:
        return value
    return marker(len(raw), hashlib.sha256(raw).hexdigest(), text, limit)
