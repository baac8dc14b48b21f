"""Values stored by reference: a result too big for its event row is stored once, outside it.

A value whose JSON is above NOETL_MAX_RESULT_BYTES is written once to `noetl_blob`, under its
execution and the SHA-256 of its JSON text (zlib-compressed when that saves a tenth or more), and
what would have held it (an event row's `result`, a variable, a loop's collection) holds its
reference instead (`limits.reference`: a small mapping with the digest, size, type, length and a
short preview). The same value written again (the step's result beside its attempt's result, a
loop's collection that is that result) is the same row: an insert that finds it does nothing.

Reading: `read` gives the whole value, through a per-process cache of decoded values bounded by
NOETL_STORED_CACHE_BYTES (the JSON size of what it holds; least recently used dropped first; a
value bigger than the whole bound is not kept). Templates read references through `reader`
(templates.render.reading); a reference is never rendered as if it were the value.

A value above NOETL_MAX_STORED_BYTES is not stored: it is truncated (limits.marker), as every
value above NOETL_MAX_RESULT_BYTES was before, and a loop over it fails naming the setting.

Secrets: the value is masked (secret_registry) before it is encoded, as an event row's content is.
"""

from __future__ import annotations

import hashlib
import json
import zlib
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any, NamedTuple

from sqlalchemy import Connection

from noetl_celery.config import limits, secret_registry
from noetl_celery.core.bounded_cache import SizeBoundedCache
from noetl_celery.store import kernel
from noetl_celery.store.db import single_read, transaction

PLAIN = "json"
ZLIB = "json+zlib"
COMPRESS_LEVEL = 1  # fast: the point is fewer bytes on the wire and on disk, not the last tenth
COMPRESS_WHEN_SAVES = 0.9  # kept compressed only when it is at most this share of the text


def encode(value: Any) -> tuple[str, bytes]:
    """The JSON text of `value` as limits.cap measures it, and its UTF-8 bytes."""
    text = json.dumps(value, default=str, ensure_ascii=False)
    return text, text.encode("utf-8")


def _packed(raw: bytes) -> tuple[str, bytes]:
    packed = zlib.compress(raw, COMPRESS_LEVEL)
    if len(packed) <= len(raw) * COMPRESS_WHEN_SAVES:
        return ZLIB, packed
    return PLAIN, raw


def _unpacked(encoding: str, data: bytes) -> Any:
    raw = zlib.decompress(data) if encoding == ZLIB else data
    return json.loads(raw)


def _fits(value: Any, limit: int) -> bool:
    """True when `value` surely fits `limit` without encoding it (as limits.cap skips it)."""
    if value is None or isinstance(value, (bool, int, float)) or limits.is_truncated(value):
        return True
    if limits.is_reference(value):
        return True
    return isinstance(value, str) and len(value) * 4 <= limit


_INSERT = (
    "INSERT INTO noetl_blob (execution_id, sha256, size, encoding, data, created_at) "
    "VALUES (?, ?, ?, ?, ?, ?) ON CONFLICT (execution_id, sha256) DO NOTHING"
)
_SELECT = "SELECT encoding, data FROM noetl_blob WHERE execution_id = ? AND sha256 = ?"


class Kept(NamedTuple):
    """A value to keep by reference (`stored_form`): the reference a row holds in its place, the
    value (masked), its JSON text's UTF-8 bytes and their SHA-256."""

    ref: dict[str, Any]
    value: Any
    raw: bytes
    digest: str


def stored_form(execution_id: int, value: Any, *, masked: bool = False) -> Any:
    """What a row holds for `value` (`put` without the write): the value itself when its JSON fits
    NOETL_MAX_RESULT_BYTES, its truncation marker above NOETL_MAX_STORED_BYTES, else `Kept`:
    the value to keep once and the reference to it. `masked`: secrets are masked already."""
    limit = limits.max_result_bytes()
    if _fits(value, limit):
        return value
    if not masked:
        value = secret_registry.mask(value)
    text, raw = encode(value)
    if len(raw) <= limit:
        return value
    kept = _kept(execution_id, value, text, raw)
    if len(raw) > limits.max_stored_bytes():
        return limits.marker(len(raw), kept.digest, text, limit)
    return kept


class Paged(NamedTuple):
    """A loop collection above the row cap (`collection_form`): what the loop row holds (the
    pages' references, the element count and how many elements a page has) and each page to keep."""

    collection: dict[str, Any]
    pages: list[Kept]


def collection_form(execution_id: int, items: list[Any]) -> Any:
    """What a loop row holds for its collection `items`: the list itself when its JSON fits
    NOETL_MAX_RESULT_BYTES, its truncation marker above NOETL_MAX_STORED_BYTES, else `Paged`: the
    list cut into pages of about NOETL_LOOP_PAGE_BYTES of JSON, each kept by reference, so that a process
    dispatching an iteration reads the page of its element, never the whole list (its decoded
    objects take several times its JSON). Every page has `per` elements (the last one fewer):
    element i is element i % per of page i // per."""
    form = stored_form(execution_id, items)
    if not isinstance(form, Kept):
        return form
    masked = form.value
    per = max(1, len(masked) * limits.loop_page_bytes() // max(len(form.raw), 1))
    pages = [_kept(execution_id, masked[start : start + per]) for start in range(0, len(masked), per)]
    collection = {  # each page's reference without its preview and message: the loop row stays small
        limits.PAGED: True,
        "length": len(masked),
        "per": per,
        "size": len(form.raw),
        "pages": [
            {limits.STORED: True, "execution_id": execution_id, "sha256": page.digest, "size": len(page.raw)}
            for page in pages
        ],
    }
    return Paged(collection, pages)


def _kept(execution_id: int, value: Any, text: str | None = None, raw: bytes | None = None) -> Kept:
    """`value` (masked already) to keep by reference whatever its size, given its JSON `text` and
    `raw` bytes when they are encoded already."""
    if text is None or raw is None:
        text, raw = encode(value)
    digest = hashlib.sha256(raw).hexdigest()
    return Kept(limits.reference(execution_id, len(raw), digest, value, text), value, raw, digest)


def _store(conn: Connection, execution_id: int, kept: Kept) -> None:
    """Write a value kept by reference, compressed when that saves (in `conn`'s transaction)."""
    encoding, data = _packed(kept.raw)
    _insert(conn, execution_id, kept.digest, len(kept.raw), encoding, data)


def put_collection(conn: Connection, execution_id: int, items: list[Any]) -> Any:
    """A loop's collection as its row holds it (`collection_form`), its pages stored (in `conn`'s
    transaction) and not kept in this process's cache: the process that dispatches an iteration
    reads the page it needs (`fetch(..., keep=False)`, engine/decision/loops.py)."""
    form = collection_form(execution_id, items)
    if not isinstance(form, Paged):
        return form
    for page in form.pages:
        _store(conn, execution_id, page)
    return form.collection


def put(conn: Connection, execution_id: int, value: Any, *, masked: bool = False) -> Any:
    """`value` as it may be stored in a row: itself when its JSON fits NOETL_MAX_RESULT_BYTES,
    else a reference to it, stored once (in `conn`'s transaction), or, above
    NOETL_MAX_STORED_BYTES, its truncation marker. `masked`: secrets are masked already.
    The value is not kept in this process's cache: a process keeps what it reads (`fetch`), and a
    value read nowhere after it was written (a loop's source, a result only a sink wanted) takes
    no memory of the process that wrote it."""
    form = stored_form(execution_id, value, masked=masked)
    if not isinstance(form, Kept):
        return form
    _store(conn, execution_id, form)
    return form.ref


def _insert(conn: Connection, execution_id: int, digest: str, size: int, encoding: str, data: bytes) -> None:
    dialect = conn.dialect
    kernel.run(
        conn,
        kernel.sql(dialect, "blob.insert", _INSERT),
        (
            execution_id,
            digest,
            size,
            encoding,
            data,
            kernel.bound(dialect, kernel.BLOBS, "created_at", kernel.utcnow()),
        ),
    )


def put_new(url: str, execution_id: int, value: Any, *, masked: bool = False) -> Any:
    """`put` in a transaction of its own (a worker's result: before its outcome is reported)."""
    if _fits(value, limits.max_result_bytes()):
        return value
    with transaction(url) as conn:
        return put(conn, execution_id, value, masked=masked)


STREAM_CHUNK = 1 << 16  # characters of JSON text a streamed value is hashed and compressed by


def put_streamed(
    conn: Connection, execution_id: int, parts: Mapping[str, Any], key: str, items: Callable[[], Iterable[Any]]
) -> Any:
    """`put` of the mapping `parts` whose member `key` is the list of what `items()` yields,
    without holding that list: its JSON text (the text `encode` gives the whole mapping, each
    item masked as `put` masks the whole) is hashed and compressed as it is written, and only
    the compressed bytes are kept (`items()` is called again if compressing saves too little to
    keep them). Returns the reference `put` would return, or None when the value is not stored
    by reference (its JSON is at most NOETL_MAX_RESULT_BYTES, or above NOETL_MAX_STORED_BYTES):
    the caller keeps the whole value then."""
    most = limits.max_stored_bytes()
    digest = hashlib.sha256()
    packer = zlib.compressobj(COMPRESS_LEVEL)
    packed: list[bytes] = []
    size = 0
    head = ""
    for chunk in _chunks(parts, key, items):
        raw = chunk.encode("utf-8")
        size += len(raw)
        if size > most:
            return None
        if len(head) < limits.PREVIEW_CHARS:
            head += chunk[: limits.PREVIEW_CHARS - len(head)]
        digest.update(raw)
        packed.append(packer.compress(raw))
    if size <= limits.max_result_bytes():
        return None
    packed.append(packer.flush())
    data = b"".join(packed)
    del packed
    encoding = ZLIB
    if len(data) > size * COMPRESS_WHEN_SAVES:
        encoding, data = PLAIN, b"".join(chunk.encode("utf-8") for chunk in _chunks(parts, key, items))
    sha256 = digest.hexdigest()
    _insert(conn, execution_id, sha256, size, encoding, data)
    return limits.reference(execution_id, size, sha256, dict(parts), head)


def _chunks(parts: Mapping[str, Any], key: str, items: Callable[[], Iterable[Any]]) -> Iterator[str]:
    """The JSON text of `parts` with `key` the list of `items()`, masked, in pieces of about
    STREAM_CHUNK characters."""
    pending: list[str] = []
    length = 0
    for piece in _pieces(parts, key, items):
        pending.append(piece)
        length += len(piece)
        if length >= STREAM_CHUNK:
            yield "".join(pending)
            pending, length = [], 0
    if pending:
        yield "".join(pending)


def _pieces(parts: Mapping[str, Any], key: str, items: Callable[[], Iterable[Any]]) -> Iterator[str]:
    """`encode`'s text of the whole mapping, piece by piece: json.dumps writes a mapping as
    `{"k": v, ...}` and a list as `[a, b, ...]` (its default separators), each member as it
    writes it alone."""

    mask = secret_registry.masker()  # the secrets as they are now, for the whole value as `put`

    def text(value: Any) -> str:
        return json.dumps(mask(value), default=str, ensure_ascii=False)

    yield "{"
    for n, (name, value) in enumerate(parts.items()):
        yield f"{', ' if n else ''}{text(name)}: "
        if name != key:
            yield text(value)
            continue
        yield "["
        for i, item in enumerate(items()):
            yield f", {text(item)}" if i else text(item)
        yield "]"
    yield "}"


def by_reference(
    conn: Connection, rows: list[dict[str, Any]], variables: dict[str, dict[str, Any]]
) -> tuple[list[dict[str, Any]], dict[str, dict[str, Any]]]:
    """A decision's event rows and variables with every `result` and variable value above
    NOETL_MAX_RESULT_BYTES stored once and replaced by its reference (`put`). A value stored
    twice in one decision (a step's result: its variable and its step.completed row) is one row."""
    execution_id = rows[0]["execution_id"] if rows else 0
    return with_references(rows, variables, lambda value: put(conn, execution_id, value))


def with_references(
    rows: list[dict[str, Any]], variables: dict[str, dict[str, Any]], keep: Callable[[Any], Any]
) -> tuple[list[dict[str, Any]], dict[str, dict[str, Any]]]:
    """`by_reference` with `keep` (`put` in a transaction) storing each value above
    NOETL_MAX_RESULT_BYTES, once per value, and giving what a row holds in its place."""
    limit = limits.max_result_bytes()
    if all(_fits(r.get("result"), limit) for r in rows) and all(
        _fits(v, limit) for values in variables.values() for v in values.values()
    ):
        return rows, variables
    stored: dict[int, Any] = {}  # id of a value -> what was stored for it

    def kept(value: Any) -> Any:
        if _fits(value, limit):
            return value
        if id(value) not in stored:
            stored[id(value)] = keep(value)
        return stored[id(value)]

    new_rows = [{**r, "result": kept(r["result"])} if "result" in r else r for r in rows]
    new_variables = {scope: {k: kept(v) for k, v in values.items()} for scope, values in variables.items()}
    return new_rows, new_variables


def fetch(conn: Connection, ref: Mapping[str, Any], *, keep: bool = True) -> Any:
    """The whole value of a reference, read through the process's cache (`keep`: kept there once
    read; a loop collection's page is not, engine/decision/loops.py keeps the few it uses)."""
    found = CACHE.get(ref)
    if found is not _MISSING:
        return found
    row = kernel.run(
        conn, kernel.sql(conn.dialect, "blob.select", _SELECT), (int(ref["execution_id"]), str(ref["sha256"]))
    ).fetchone()
    if row is None:
        raise LookupError(
            f"the value stored by reference {ref['sha256'][:12]} of execution {ref['execution_id']} is gone "
            "(pruned with its execution?)"
        )
    value = _unpacked(row[0], bytes(row[1]))
    if keep:
        CACHE.keep(ref, value)
    return value


def reader(conn: Connection) -> Callable[[Mapping[str, Any]], Any]:
    """What templates read references with (templates.render.reading), in `conn`'s transaction."""
    return lambda ref: fetch(conn, ref)


def url_reader(url: str) -> Callable[[Mapping[str, Any]], Any]:
    """What templates read references with, each read (not found in the cache) a statement of its own."""

    def read(ref: Mapping[str, Any]) -> Any:
        found = CACHE.get(ref)
        if found is not _MISSING:
            return found
        with single_read(url) as conn:
            return fetch(conn, ref)

    return read


_MISSING = object()


class ValueCache(SizeBoundedCache):
    """Values stored by reference, decoded, by their reference (`get`/`keep`), in a
    `SizeBoundedCache` bounded by default by NOETL_STORED_CACHE_BYTES."""

    def __init__(self, bound: Callable[[], int] | None = None) -> None:
        super().__init__(bound or (lambda: limits.stored_cache_bytes()))

    @staticmethod
    def _key(ref: Mapping[str, Any]) -> tuple[int, str]:
        return int(ref["execution_id"]), str(ref["sha256"])

    def get(self, ref: Mapping[str, Any]) -> Any:
        return self.lookup(self._key(ref), _MISSING)

    def keep(self, ref: Mapping[str, Any], value: Any) -> None:
        self.hold(self._key(ref), int(ref["size"]), value)


CACHE = ValueCache()
