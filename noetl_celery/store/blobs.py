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

Long lists are never held as one text: `put` encodes a list of more than LIST_SLICE elements a
slice at a time, and a loop's pages are made from a stored list as its text is unpacked and
decoded (`stored_collection_form`, `array_elements`).
"""

from __future__ import annotations

import codecs
import hashlib
import json
import re
import zlib
from collections.abc import Callable, Iterable, Iterator, Mapping
from datetime import datetime
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


def collection_form(execution_id: int, items: list[Any], keep: Callable[[Kept], None]) -> Any:
    """What a loop row holds for its collection `items`: the list itself when its JSON fits
    NOETL_MAX_RESULT_BYTES, its truncation marker above NOETL_MAX_STORED_BYTES, else its pages:
    the list cut into pages of about NOETL_LOOP_PAGE_BYTES of JSON, each handed to `keep` (which
    stores it) as it is made, so that a process dispatching an iteration reads the page of its
    element, never the whole list (its decoded objects take several times its JSON). Every page
    has `per` elements (the last one fewer): element i is element i % per of page i // per."""
    form = stored_form(execution_id, items)
    if not isinstance(form, Kept):
        return form
    masked, size = form.value, len(form.raw)
    del form  # the whole list's text is not held while its pages are made
    per = _per_page(len(masked), size)
    pages = (masked[start : start + per] for start in range(0, len(masked), per))
    return _paged(execution_id, len(masked), size, per, pages, keep)


def stored_collection_form(
    execution_id: int,
    source: Mapping[str, Any],
    encoding: str,
    pieces: Iterable[bytes],
    keep: Callable[[Kept], None],
) -> dict[str, Any]:
    """`collection_form` of the list stored by reference as `source` (its stored `encoding`, and
    its stored bytes in `pieces`), read element by element as its text is unpacked
    (`array_elements`): the pages are the ones `collection_form` makes of the decoded list, and
    the whole list is never held, as neither its objects nor its text. `source` is above
    NOETL_MAX_RESULT_BYTES and at most NOETL_MAX_STORED_BYTES (engine/decision/loops.py
    `stored_source`)."""
    length, size = int(source["length"]), int(source["size"])
    per = _per_page(length, size)
    mask = secret_registry.masker()
    pages = (mask(page) for page in _in_pages(array_elements(_texts(encoding, pieces)), per, length))
    return _paged(execution_id, length, size, per, pages, keep)


def _per_page(length: int, size: int) -> int:
    """Elements per page of a list of `length` elements and `size` bytes of JSON."""
    return max(1, length * limits.loop_page_bytes() // max(size, 1))


def _in_pages(elements: Iterable[Any], per: int, length: int) -> Iterator[list[Any]]:
    page: list[Any] = []
    count = 0
    for element in elements:
        page.append(element)
        count += 1
        if len(page) == per:
            yield page
            page = []
    if page:
        yield page
    if count != length:
        raise ValueError(f"the stored list has {count} elements where its reference says {length}")


def _paged(
    execution_id: int, length: int, size: int, per: int, pages: Iterable[list[Any]], keep: Callable[[Kept], None]
) -> dict[str, Any]:
    """What a loop row holds for a collection in pages: each page's reference without its preview
    and message (the loop row stays small), the element count and the elements per page."""
    refs = []
    for page in pages:
        kept = _kept(execution_id, page)
        keep(kept)
        refs.append({limits.STORED: True, "execution_id": execution_id, "sha256": kept.digest, "size": len(kept.raw)})
    return {limits.PAGED: True, "length": length, "per": per, "size": size, "pages": refs}


_SPACE = re.compile(r"[ \t\n\r]*")
_DECODER = json.JSONDecoder()


def _texts(encoding: str, pieces: Iterable[bytes]) -> Iterator[str]:
    """The JSON text stored as the concatenation of `pieces`, unpacked piece by piece."""
    utf8 = codecs.getincrementaldecoder("utf-8")()
    unpack = zlib.decompressobj() if encoding == ZLIB else None
    for data in pieces:
        for start in range(0, len(data), STREAM_CHUNK):
            piece = data[start : start + STREAM_CHUNK]
            yield utf8.decode(unpack.decompress(piece) if unpack is not None else piece)
    yield utf8.decode(unpack.flush() if unpack is not None else b"", final=True)


def array_elements(texts: Iterable[str]) -> Iterator[Any]:
    """The elements of the JSON array whose text is the concatenation of `texts`, each decoded
    as soon as the text holds all of it (a number counts as whole once a `,` or `]` follows it):
    what `json.loads` gives of the whole text, one element at a time. A text that is not one
    JSON array raises ValueError."""
    source = iter(texts)
    buf, pos, more, batch = "", 0, True, True
    state = "open"  # open -> first -> (value -> after)* -> closed
    while state != "closed":
        pos = _SPACE.match(buf, pos).end()  # type: ignore[union-attr]
        if state == "value" and pos < len(buf) and batch:
            run = _run(buf, pos)
            batch = run is not None  # else one by one until more text is read
            if run is not None:  # the elements up to a comma near the text's end, at once
                elements, pos = run
                yield from elements
                continue
        if pos >= len(buf) or state == "value":
            element = _element(buf, pos, more) if pos < len(buf) else None
            if element is None:  # the text so far ends inside the next token: read on
                if not more:
                    raise ValueError(f"the JSON array's text ends early (at {state})")
                try:
                    buf, pos, batch = buf[pos:] + next(source), 0, True
                except StopIteration:
                    more = False
                continue
            value, pos = element
            yield value
            state = "after"
            continue
        char = buf[pos]
        if state == "open" and char == "[":
            state = "first"
        elif state == "first":
            state = "closed" if char == "]" else "value"
            if state == "value":
                continue
        elif state == "after" and char in ",]":
            state = "value" if char == "," else "closed"
        else:
            raise ValueError(f"the text is not a JSON array: {char!r} where {state} was expected")
        pos += 1


def _run(buf: str, pos: int) -> tuple[list[Any], int] | None:
    """The elements from `pos` up to a comma near the end of the text, decoded at once, and where
    the next one starts; None when no such comma is between two elements. Tried: the last comma,
    then the last one after a closing brace, bracket or quote (between mappings, lists or strings
    as json.dumps separates them). A comma inside a string or a nested value is never taken for
    one between elements: the text up to it does not close as one array."""
    tried = set()
    for cut in (buf.rfind(",", pos), buf.rfind("}, ", pos) + 1, buf.rfind("], ", pos) + 1, buf.rfind('", ', pos) + 1):
        if cut <= pos or cut in tried:
            continue
        tried.add(cut)
        try:
            return json.loads(f"[{buf[pos:cut]}]"), cut + 1
        except ValueError:
            continue
    return None


def _element(buf: str, pos: int, more: bool) -> tuple[Any, int] | None:
    """The element whose text starts at `pos` and where it ends, or None when `buf` does not hold
    all of it yet (`more`: more text is to come)."""
    try:
        value, end = _DECODER.raw_decode(buf, pos)
    except ValueError:
        if more:
            return None
        raise
    after = _SPACE.match(buf, end).end()  # type: ignore[union-attr]
    if more and (after >= len(buf) or buf[after] not in ",]"):
        return None  # a number may go on in the next piece (`12` of `123`, `1.5` of `1.5e3`)
    return value, end


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


def put_collection(
    conn: Connection, execution_id: int, items: list[Any], source: Mapping[str, Any] | None = None
) -> Any:
    """A loop's collection as its row holds it (`collection_form`), its pages stored (in `conn`'s
    transaction) and not kept in this process's cache: the process that dispatches an iteration
    reads the page it needs (`fetch(..., keep=False)`, engine/decision/loops.py). With `source`
    (a list stored by reference; `items` unused), the pages are made as that list is read
    (`stored_collection_form`)."""

    def keep(page: Kept) -> None:
        _store(conn, execution_id, page)

    if source is None:
        return collection_form(execution_id, items, keep)
    encoding, pieces = _stored_pieces(conn, source)
    return stored_collection_form(execution_id, source, encoding, pieces, keep)


LIST_SLICE = 10_000  # elements of a big list encoded at a time (`put`)


def _list_pieces(items: list[Any], mask: Callable[[Any], Any]) -> Iterator[str]:
    """`encode`'s text of the list `items`, masked, LIST_SLICE elements at a time: json.dumps
    writes a list as `[a, b, ...]`, so each slice's text without its brackets, joined by `, `."""
    yield "["
    for start in range(0, len(items), LIST_SLICE):
        text = json.dumps(mask(items[start : start + LIST_SLICE]), default=str, ensure_ascii=False)
        yield f", {text[1:-1]}" if start else text[1:-1]
    yield "]"


def put(conn: Connection, execution_id: int, value: Any, *, masked: bool = False) -> Any:
    """`value` as it may be stored in a row: itself when its JSON fits NOETL_MAX_RESULT_BYTES,
    else a reference to it, stored once (in `conn`'s transaction), or, above
    NOETL_MAX_STORED_BYTES, its truncation marker. `masked`: secrets are masked already.
    The value is not kept in this process's cache: a process keeps what it reads (`fetch`), and a
    value read nowhere after it was written (a loop's source, a result only a sink wanted) takes
    no memory of the process that wrote it. A list of more than LIST_SLICE elements is encoded,
    hashed and compressed a slice at a time: its whole text is never held (a million small
    integers: 6.9 MB of text, twice, as characters and as bytes)."""
    if isinstance(value, list) and len(value) > LIST_SLICE:
        mask = secret_registry.masker(masked=masked)
        ref = _put_text(conn, execution_id, lambda: _chunks(_list_pieces(value, mask)), value)
        if ref is not None:
            return ref
    form = stored_form(execution_id, value, masked=masked)
    if not isinstance(form, Kept):
        return form
    _store(conn, execution_id, form)
    return form.ref


class _Written:
    """Whether this process stored a value by reference since `take_written` last asked."""

    since = False


def take_written() -> bool:
    """True once after this process stored a value by reference (each is above the row cap, and
    its objects took several times that while it was built): the worker then hands the memory
    freed since back to the system (engine/transport/process.py `release_freed_memory`)."""
    written, _Written.since = _Written.since, False
    return written


def _insert(
    conn: Connection, execution_id: int, digest: str, size: int, encoding: str, data: bytes | bytearray
) -> None:
    _Written.since = True
    dialect = conn.dialect
    created_at = kernel.utcnow()
    if len(data) > limits.store_piece_bytes() and kernel.copies(conn):
        _insert_copied(conn, (execution_id, digest, size, encoding, created_at), data)
        return
    kernel.run(
        conn,
        kernel.sql(dialect, "blob.insert", _INSERT),
        (execution_id, digest, size, encoding, data, kernel.bound(dialect, kernel.BLOBS, "created_at", created_at)),
    )


BLOB_LOCKS = 0x6E6F6574  # the first key of the advisory locks that serialise writers of one value
_HOLD_THEN_FIND = (  # two statements, each with its own snapshot: the second sees what the lock waited for
    "SELECT pg_advisory_xact_lock(?, hashtext(?)); SELECT 1 FROM noetl_blob WHERE execution_id = ? AND sha256 = ?"
)
_COPY_IN = "COPY noetl_blob (execution_id, sha256, size, encoding, created_at, data) FROM STDIN"


def _insert_copied(conn: Connection, columns: tuple[int, str, int, str, datetime], data: bytes | bytearray) -> None:
    """The insert of a value stored by reference whose stored bytes are above
    NOETL_STORE_PIECE_BYTES, on PostgreSQL: its row goes by COPY, its bytes written as they are
    sent (an insert's parameter is the bytes escaped as text, twice their size, and the statement
    holding that: several times the value in this process). COPY has no ON CONFLICT: a
    transaction-level advisory lock on the value's key makes writers of the same value wait for
    each other, and one that finds the row written (committed by the one it waited for, or
    earlier in its own transaction) writes nothing, as the insert's ON CONFLICT DO NOTHING does.
    Needs no privilege beyond the insert's."""
    execution_id, digest, size, encoding, created_at = columns
    found = kernel.run_text(
        conn,
        kernel.dialect_sql(conn.dialect, _HOLD_THEN_FIND),
        (BLOB_LOCKS, f"{execution_id} {digest}", execution_id, digest),
    ).fetchone()
    if found is not None:
        return
    head = f"{execution_id}\t{digest}\t{size}\t{encoding}\t{created_at.isoformat()}\t"
    kernel.copy_in(conn, _COPY_IN, _copy_row(head.encode("ascii"), data))


def _copy_row(head: bytes, data: bytes | bytearray) -> Iterator[bytes]:
    """One row of COPY's text format: `head` (the columns before the bytea, each followed by a
    tab), then `data` as a bytea (`\\x` and its hex digits, the backslash doubled as the format
    asks), a piece at a time."""
    yield head + b"\\\\x"
    view = memoryview(data)
    for start in range(0, len(view), STREAM_CHUNK):
        yield view[start : start + STREAM_CHUNK].hex().encode("ascii")
    yield b"\n"


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
    return _put_text(conn, execution_id, lambda: _chunks(_pieces(parts, key, items)), dict(parts))


def _put_text(conn: Connection, execution_id: int, chunks: Callable[[], Iterable[str]], shape: Any) -> Any:
    """Store the value whose JSON text `chunks()` gives piece by piece (called again when
    compressing saves too little), hashing and compressing it as it comes; `shape` is the value
    or a value of its type and length, for its reference. None: not stored (see `put_streamed`)."""
    most = limits.max_stored_bytes()
    digest = hashlib.sha256()
    packer = zlib.compressobj(COMPRESS_LEVEL)
    packed = bytearray()  # grown in place: never its pieces and their join at once
    size = 0
    head = ""
    for chunk in chunks():
        raw = chunk.encode("utf-8")
        size += len(raw)
        if size > most:
            return None
        if len(head) < limits.PREVIEW_CHARS:
            head += chunk[: limits.PREVIEW_CHARS - len(head)]
        digest.update(raw)
        packed += packer.compress(raw)
    if size <= limits.max_result_bytes():
        return None
    packed += packer.flush()
    encoding, data = ZLIB, packed
    if len(data) > size * COMPRESS_WHEN_SAVES:
        del packed, data
        encoding, data = PLAIN, bytearray()
        for chunk in chunks():
            data += chunk.encode("utf-8")
    sha256 = digest.hexdigest()
    _insert(conn, execution_id, sha256, size, encoding, data)
    return limits.reference(execution_id, size, sha256, shape, head)


def _chunks(pieces: Iterable[str]) -> Iterator[str]:
    """The text of `pieces` in pieces of about STREAM_CHUNK characters."""
    pending: list[str] = []
    length = 0
    for piece in pieces:
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
    encoding, data = _stored_row(conn, ref)
    value = _unpacked(encoding, bytes(data))
    if keep:
        CACHE.keep(ref, value)
    return value


def _stored_row(conn: Connection, ref: Mapping[str, Any]) -> tuple[str, bytes]:
    """The stored encoding and data of the value `ref` names (LookupError: it is gone)."""
    row = kernel.run(conn, kernel.sql(conn.dialect, "blob.select", _SELECT), _key(ref)).fetchone()
    if row is None:
        raise _gone(ref)
    return row[0], row[1]


_LENGTH = "SELECT encoding, length(data) FROM noetl_blob WHERE execution_id = ? AND sha256 = ?"
_PIECE = "SELECT substr(data, ?, ?) FROM noetl_blob WHERE execution_id = ? AND sha256 = ?"


def _stored_pieces(conn: Connection, ref: Mapping[str, Any]) -> tuple[str, Iterator[bytes]]:
    """The stored encoding of the value `ref` names and its stored bytes, read
    NOETL_STORE_PIECE_BYTES at a time as they are iterated (in `conn`'s transaction): the bytes
    of a big value are never all in this process at once, nor their escaped text (LookupError:
    it is gone)."""
    key = _key(ref)
    row = kernel.run(conn, kernel.sql(conn.dialect, "blob.length", _LENGTH), key).fetchone()
    if row is None:
        raise _gone(ref)
    encoding, length = row[0], int(row[1])
    each = limits.store_piece_bytes()

    def pieces() -> Iterator[bytes]:
        for start in range(0, length, each):
            sql = kernel.sql(conn.dialect, "blob.piece", _PIECE)
            piece = kernel.run(conn, sql, (start + 1, each, *key)).fetchone()
            if piece is None:
                raise _gone(ref)
            yield bytes(piece[0])

    return encoding, pieces()


def _key(ref: Mapping[str, Any]) -> tuple[int, str]:
    return int(ref["execution_id"]), str(ref["sha256"])


def _gone(ref: Mapping[str, Any]) -> LookupError:
    return LookupError(
        f"the value stored by reference {ref['sha256'][:12]} of execution {ref['execution_id']} is gone "
        "(pruned with its execution?)"
    )


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
