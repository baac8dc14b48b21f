"""Where a file endpoint's bytes come from and go to: the seam between the formats (CSV, JSONL,
Parquet, which only see binary streams) and the storage that holds them.

`open_stream(location, mode, credential)` is the one entry point: a context manager giving a
binary stream to read ("rb") or write ("wb"). Local paths are served here; a written file is
put at `<path>.part-<pid>` and renamed over the path only when the copy ends well, so a reader
(or a retry) never meets half a file. A location with a scheme (`s3://`, `gs://`, ...) goes to
the opener registered for that scheme (`register_opener`); when none is registered the module
`noetl_celery.tools.object_store` serves it: `open_read(location, credential)` to read, and
`open_write(location, credential)` to write (the object is created only when the copy ends
well); its ObjectStoreError becomes a PlanError for a location it cannot name (a bucket without
an object, a missing extra) and is raised through otherwise, with its error kind. Without that
module the location is refused by name. An opener must give a whole-object write (nothing
visible before a clean close) for the same guarantee.
"""

from __future__ import annotations

import contextlib
import importlib
import os
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from pathlib import Path
from typing import IO, Any
from urllib.parse import urlsplit

from noetl_celery.core.vocabulary import ToolErrorKind
from noetl_celery.tools.transfer.plan import PlanError

Opener = Callable[[str, str, Any], AbstractContextManager[IO[bytes]]]
OBJECT_STORE_MODULE = "noetl_celery.tools.object_store"
_OPENERS: dict[str, Opener] = {}


def register_opener(scheme: str, opener: Opener) -> None:
    """Serve locations of `scheme` (`s3`, `gs`, ...) with `opener(location, mode, credential)`."""
    _OPENERS[scheme.lower()] = opener


def scheme_of(location: str) -> str | None:
    scheme = urlsplit(location).scheme.lower()
    return scheme if len(scheme) > 1 and scheme != "file" else None  # "c:" is a drive, not a scheme


@contextlib.contextmanager
def open_stream(location: str, mode: str, credential: Any = None) -> Iterator[IO[bytes]]:
    """A binary stream on `location` for reading ("rb") or writing the whole object ("wb")."""
    scheme = scheme_of(location)
    if scheme is None:
        path = Path(location[len("file://") :] if location.startswith("file://") else location).expanduser()
        with _local(path, mode) as stream:
            yield stream
        return
    opener = _OPENERS.get(scheme) or _object_store_opener(scheme)
    with opener(location, mode, credential) as stream:
        yield stream


def _object_store_opener(scheme: str) -> Opener:
    try:
        store = importlib.import_module(OBJECT_STORE_MODULE)
    except ImportError:
        raise PlanError(f"no storage for {scheme}:// locations in this installation (a local path works)") from None
    if scheme not in store.SCHEMES:
        raise PlanError(f"no storage for {scheme}:// locations (known: s3://, gs://, a local path)")

    @contextlib.contextmanager
    def opener(location: str, mode: str, credential: Any) -> Iterator[IO[bytes]]:
        try:
            opened = store.open_read(location, credential) if mode == "rb" else store.open_write(location, credential)
        except store.ObjectStoreError as exc:
            if exc.kind in (ToolErrorKind.INVALID_ARGS, ToolErrorKind.UNKNOWN_TOOL):
                raise PlanError(str(exc)) from None
            raise
        with opened as stream:
            yield stream

    return opener


@contextlib.contextmanager
def _local(path: Path, mode: str) -> Iterator[IO[bytes]]:
    if mode == "rb":
        if not path.is_file():
            raise PlanError(f"source file {str(path)!r} does not exist")
        with path.open("rb") as stream:
            yield stream
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    part = path.with_name(f"{path.name}.part-{os.getpid()}")
    try:
        with part.open("wb") as stream:
            yield stream
        os.replace(part, path)
    finally:
        with contextlib.suppress(FileNotFoundError):
            part.unlink()
