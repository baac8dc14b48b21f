"""File formats of `transfer`: CSV, JSONL and Parquet, read and written in chunks on binary
streams (streams.open_stream gives them, from a local path or object storage).

Decides: the format of a file endpoint (`format:`, else the type `csv|jsonl|parquet`, else the
path's suffix: .csv, .jsonl/.ndjson/.json, .parquet/.pq); CSV has a header row, an empty cell
reads as null and null is written empty; JSONL is one object per line; Parquet (pyarrow, the
`parquet` extra) is read a row group batch at a time and written a row group per chunk, its
schema fixed by the first chunk. Values a format cannot hold as they are (dates, decimals,
UUIDs in CSV/JSONL) are written as their JSON form (jsonable.to_jsonable).
"""

from __future__ import annotations

import csv
import io
import json
import shutil
import tempfile
from collections.abc import Iterator
from typing import IO, Any

from noetl_celery.core.jsonable import to_jsonable
from noetl_celery.tools.transfer.plan import Endpoint, PlanError
from noetl_celery.tools.transfer.rows import Chunk, chunks_of_objects

FORMATS = ("csv", "jsonl", "parquet")
_SUFFIXES = {
    ".csv": "csv",
    ".jsonl": "jsonl",
    ".ndjson": "jsonl",
    ".json": "jsonl",
    ".parquet": "parquet",
    ".pq": "parquet",
}
SPOOL_IN_MEMORY = 64 * 1024 * 1024  # bytes of a non-seekable Parquet source kept in memory before disk


def location_of(endpoint: Endpoint) -> str:
    return str(endpoint.text("path", "url", "uri", "file"))


def format_of(endpoint: Endpoint) -> str:
    named = endpoint.text("format")
    if named:
        fmt = {"ndjson": "jsonl", "json": "jsonl"}.get(named.lower(), named.lower())
    elif endpoint.type in FORMATS:
        fmt = endpoint.type
    else:
        location = location_of(endpoint).lower().split("?")[0]
        fmt = next((f for suffix, f in _SUFFIXES.items() if location.endswith(suffix)), "")
    if fmt not in FORMATS:
        raise PlanError(f"{endpoint.side}.format: say csv, jsonl or parquet (the path's suffix does not tell)")
    return fmt


def read_chunks(stream: IO[bytes], fmt: str, size: int, strict: bool, where: str) -> Iterator[Chunk]:
    if fmt == "parquet":
        yield from _read_parquet(stream, size)
        return
    text = io.TextIOWrapper(stream, encoding="utf-8", newline="")
    if fmt == "csv":
        rows = ({k: (v if v != "" else None) for k, v in row.items()} for row in csv.DictReader(text))
        yield from chunks_of_objects(rows, size, where, strict)
    else:
        yield from chunks_of_objects(_json_lines(text, where), size, where, strict)


def _json_lines(text: IO[str], where: str) -> Iterator[Any]:
    for number, line in enumerate(text, start=1):
        if line.strip():
            try:
                yield json.loads(line)
            except json.JSONDecodeError as exc:
                raise PlanError(f"{where}: line {number} is not JSON ({exc.msg})") from None


def _read_parquet(stream: IO[bytes], size: int) -> Iterator[Chunk]:
    import pyarrow.parquet as pq

    with _seekable(stream) as seekable:
        parquet = pq.ParquetFile(seekable)
        columns = parquet.schema_arrow.names
        for batch in parquet.iter_batches(batch_size=size):
            values = [batch.column(i).to_pylist() for i in range(batch.num_columns)]
            yield Chunk(list(columns), list(zip(*values, strict=True)))


class _Spool:
    def __init__(self, stream: IO[bytes]) -> None:
        self.stream = stream
        self.copy: Any = None

    def __enter__(self) -> IO[bytes]:
        if self.stream.seekable():
            return self.stream
        self.copy = tempfile.SpooledTemporaryFile(max_size=SPOOL_IN_MEMORY)
        shutil.copyfileobj(self.stream, self.copy)
        self.copy.seek(0)
        return self.copy  # type: ignore[no-any-return]

    def __exit__(self, *exc: object) -> None:
        if self.copy is not None:
            self.copy.close()


def _seekable(stream: IO[bytes]) -> _Spool:
    """Parquet reads its footer first: a stream that cannot seek is copied to a spool file."""
    return _Spool(stream)


class FileWriter:
    """Writes chunks to one binary stream in one format."""

    def __init__(self, stream: IO[bytes], fmt: str) -> None:
        self.stream, self.fmt = stream, fmt
        self.text: io.TextIOWrapper | None = None
        self.csv: Any = None
        self.parquet: Any = None
        self.schema: Any = None
        self.columns: list[str] = []

    def write(self, chunk: Chunk) -> int:
        if self.fmt == "parquet":
            self._write_parquet(chunk)
            return len(chunk.rows)
        if self.text is None:
            self.text = io.TextIOWrapper(self.stream, encoding="utf-8", newline="", write_through=False)
            self.columns = chunk.columns
            if self.fmt == "csv":
                self.csv = csv.writer(self.text)
                self.csv.writerow(self.columns)
        if self.fmt == "csv":
            self.csv.writerows([_csv_cell(v) for v in row] for row in chunk.rows)
        else:
            lines = (json.dumps(to_jsonable(dict(zip(chunk.columns, row, strict=True)))) for row in chunk.rows)
            self.text.write("\n".join(lines) + "\n")
        return len(chunk.rows)

    def _write_parquet(self, chunk: Chunk) -> None:
        import pyarrow as pa
        import pyarrow.parquet as pq

        data = {name: [row[i] for row in chunk.rows] for i, name in enumerate(chunk.columns)}
        if self.parquet is None:
            self.schema = _widened(pa.table(data).schema)
            self.parquet = pq.ParquetWriter(self.stream, self.schema)
        table = pa.Table.from_pydict(data, schema=self.schema)
        self.parquet.write_table(table)

    def finish(self) -> None:
        if self.parquet is not None:
            self.parquet.close()
        if self.text is not None:
            self.text.flush()
            self.text.detach()  # the stream is the caller's to close


def _widened(schema: Any) -> Any:
    """The first chunk's schema with each decimal column at the widest precision of its scale: a
    later chunk's larger numbers (1000.00 after 999.99) must fit the file's one schema."""
    import pyarrow as pa

    def widen(field: Any) -> Any:
        if pa.types.is_decimal(field.type) and field.type.precision < 38:
            return field.with_type(pa.decimal128(38, min(field.type.scale, 38)))
        return field

    return pa.schema([widen(field) for field in schema], metadata=schema.metadata)


def _csv_cell(value: Any) -> Any:
    if value is None or isinstance(value, (str, int, float)):
        return "" if value is None else value
    plain = to_jsonable(value)
    return json.dumps(plain) if isinstance(plain, (dict, list)) else plain
