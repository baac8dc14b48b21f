"""The `transfer` tool: copy rows from a source to a target in chunks, NoETL's source -> target
form, between PostgreSQL, MySQL/MariaDB, DuckDB, SQLite, Snowflake, HTTP (JSON) and files (CSV,
JSONL, Parquet) on a local path or object storage.

Config (rendered): `source: {type, auth, query | table | url | path, ...}`, `target: {type, auth,
table | query | url | path, mapping, ...}`, `mode` (append, the default; insert; replace;
upsert), `chunk_size` (rows per chunk, default 1000), `key` (the upsert key). The task's own
`auth:` is the credential of a side that names none. Memory holds one chunk (and, for an http
source, its response body). Data, NoETL's shape: {status: "success", direction:
"<source>_to_<target>", source_type, target_type, mode, rows_transferred, chunks_processed,
target_table (the table, path or URL), columns}.

Retries: a copy that fails part way leaves the chunks it committed (append/insert/upsert commit
each chunk; replace is one transaction; a file is renamed into place only when whole). Run
again, upsert writes each keyed row once and replace writes the table whole again; append
has no key, so it would write the committed chunks twice (use upsert or replace for a step
with retries). Errors: invalid_args (the settings, naming the field), credential, connection
(retryable), sql_error (the database refused; retryable for deadlocks and serialization
failures), request_error / server_error for http, each saying which side failed. Secrets of
both sides' credentials are handed to the worker's masking and never appear in the outcome.
"""

from __future__ import annotations

import contextlib
import functools
import time
from collections.abc import Iterator
from typing import Any

from pydantic import ValidationInfo, field_validator

from noetl_celery.config import credentials
from noetl_celery.core.errors import CredentialError
from noetl_celery.core.vocabulary import ToolErrorKind
from noetl_celery.tools.base import SECRET_VALUES_META, Outcome, ToolCall, missing_extra, register
from noetl_celery.tools.pool import SoftTimeLimitExceeded  # the attempt's time limit: run_tool reports it
from noetl_celery.tools.settings import TEMPLATE_MARKERS, ToolSettings
from noetl_celery.tools.transfer import databases, formats, streams, web
from noetl_celery.tools.transfer.failures import SideError, classify
from noetl_celery.tools.transfer.plan import (
    FILE_TYPES,
    SQL_TYPES,
    Endpoint,
    PlanError,
    TransferPlan,
    read_endpoint,
    read_mode,
    read_plan,
)
from noetl_celery.tools.transfer.rows import Chunk, projection

# raised through as they are: the plan's and the credential's own errors, a side's failure
# already tagged, and the time limit (run_tool makes it a `timeout` outcome)
PASS_THROUGH = (PlanError, CredentialError, SideError, SoftTimeLimitExceeded)
# the endpoint types (and the format) that need a library of an optional extra
ENDPOINT_EXTRAS = {
    "mysql": ("mysql", ("pymysql",)),
    "duckdb": ("duckdb", ("duckdb",)),
    "snowflake": ("snowflake", ("snowflake.connector",)),
}
PARQUET_EXTRA = ("parquet", ("pyarrow",))


class TransferSettings(ToolSettings):
    """Checked at validate on the values a playbook writes (templates are checked once rendered):
    an endpoint type this tool does not have, or whose library (extra) is not installed, and a
    mode it does not know are refused by name before the playbook runs."""

    source: dict[str, Any] | None = None
    target: dict[str, Any] | None = None
    chunk_size: int | None = None
    batch_size: int | None = None
    mode: str | None = None
    key: str | list[str] | None = None
    mapping: dict[str, str] | None = None

    @field_validator("source", "target")
    @classmethod
    def _endpoint_can_run(cls, value: dict[str, Any] | None, info: ValidationInfo) -> dict[str, Any] | None:
        refusal = endpoint_refusal(str(info.field_name), value) if value else None
        if refusal:
            raise ValueError(refusal)
        return value

    @field_validator("mode")
    @classmethod
    def _known_mode(cls, value: str | None) -> str | None:
        if value is not None and not is_template(value):
            read_mode(value)  # PlanError is a ValueError: its message is the refusal
        return value


def endpoint_refusal(side: str, settings: dict[str, Any]) -> str | None:
    """Why the endpoint written as `settings` cannot run here (an unknown type, a missing extra),
    or None; a templated value is left to the run."""
    if any(is_template(v) for v in settings.values()):
        literal = {k: v for k, v in settings.items() if not is_template(v)}
        if not any(k in literal for k in ("type", "kind", "tool")):
            return None
        settings = literal
    try:
        endpoint = read_endpoint(side, settings, require_fields=False)
        return _missing_library_of(endpoint)
    except PlanError as exc:
        return str(exc)


@register(
    "transfer",
    fields={"source", "target", "chunk_size", "batch_size", "mode", "key", "mapping"},
    required=({"source"}, {"target"}),
    settings=TransferSettings,
    resolves_auth=True,
)
def run_transfer(call: ToolCall) -> Outcome:
    """Copy the source's rows into the target, a chunk at a time."""
    secrets: set[str] = set()
    outcome = _run(call, secrets)
    if secrets:
        outcome.meta[SECRET_VALUES_META] = sorted(s for s in secrets if s)
    return outcome


def _run(call: ToolCall, secrets: set[str]) -> Outcome:
    try:
        plan = read_plan(call.config)
        missing = _missing_library(plan)
        if missing:
            return Outcome.fail(ToolErrorKind.UNKNOWN_TOOL, missing)
        creds = {side: _credential(call, getattr(plan, side), secrets) for side in ("source", "target")}
        started = time.monotonic()
        rows, chunks, columns = _copy(plan, call, creds, secrets)
    except PlanError as exc:
        return Outcome.fail(ToolErrorKind.INVALID_ARGS, f"transfer: {credentials.scrub(str(exc), secrets)}")
    except CredentialError as exc:
        return Outcome.fail(ToolErrorKind.CREDENTIAL, f"transfer: {exc}")
    except SideError as exc:
        kind, retryable, message = classify(exc, secrets)
        return Outcome.fail(kind, f"transfer: {message}", retryable)
    return Outcome.ok(
        {
            "status": "success",
            "direction": plan.direction,
            "source_type": plan.source.type,
            "target_type": plan.target.type,
            "mode": plan.mode,
            "rows_transferred": rows,
            "chunks_processed": chunks,
            "target_table": _target_name(plan.target),
            "columns": columns,
            "elapsed": round(time.monotonic() - started, 3),
        }
    )


def _missing_library(plan: TransferPlan) -> str | None:
    return _missing_library_of(plan.source) or _missing_library_of(plan.target)


def _missing_library_of(endpoint: Endpoint) -> str | None:
    """The `pip install` line for the library the endpoint needs, when it is not installed."""
    if endpoint.type in ENDPOINT_EXTRAS:
        extra, modules = ENDPOINT_EXTRAS[endpoint.type]
        return missing_extra(f"transfer {endpoint.side} type '{endpoint.type}'", extra, modules)
    if endpoint.type in FILE_TYPES and endpoint.get("path", "url", "uri", "file", "format"):
        with contextlib.suppress(PlanError):  # a format not known yet (a templated path) is the run's to say
            if formats.format_of(endpoint) == "parquet":
                return missing_extra(f"transfer {endpoint.side} format 'parquet'", *PARQUET_EXTRA)
    return None


def is_template(value: Any) -> bool:
    return isinstance(value, str) and any(marker in value for marker in TEMPLATE_MARKERS)


def _credential(call: ToolCall, endpoint: Endpoint, secrets: set[str]) -> Any:
    ref = endpoint.get("auth", "credential")
    credential = credentials.resolve(ref) if ref is not None else None
    if credential is None and call.config.get("auth") is not None:
        credential = credentials.resolve(call.config["auth"])
    if credential is None:
        credential = call.credential
    if credential is not None:
        secrets |= credentials.secret_values(credential)
    return credential


def _copy(plan: TransferPlan, call: ToolCall, creds: dict[str, Any], secrets: set[str]) -> tuple[int, int, list[str]]:
    rows = chunks = 0
    columns: list[str] = []
    with contextlib.ExitStack() as stack:
        source = _guarded("source", plan.source.type, lambda: _open_source(plan, call, creds["source"], secrets, stack))
        writer = _guarded("target", plan.target.type, lambda: _open_target(plan, call, creds["target"], secrets, stack))
        project = None
        for chunk in _tagged(source, plan.source.type):
            if not chunks:
                columns, project = projection(chunk.columns, plan.mapping)
            out = Chunk(columns, [project(r) for r in chunk.rows] if project else chunk.rows)
            rows += _guarded("target", plan.target.type, functools.partial(writer.write, out))
            chunks += 1
        _guarded("target", plan.target.type, writer.finish)
        # a file target's object is stored as its stream closes: a failure there is the target's
        _guarded("target", plan.target.type, stack.close)
    return rows, chunks, columns


def _guarded(side: str, kind: str, action: Any) -> Any:
    """`action()`, a failure of the side's library raised as SideError (a PlanError passes)."""
    try:
        return action()
    except PASS_THROUGH:
        raise
    except Exception as exc:
        raise SideError(side, kind, exc) from exc


def _tagged(chunks: Iterator[Chunk], kind: str) -> Iterator[Chunk]:
    while True:
        try:
            chunk = next(chunks)
        except StopIteration:
            return
        except PASS_THROUGH:
            raise
        except Exception as exc:
            raise SideError("source", kind, exc) from exc
        yield chunk


def _where(call: ToolCall, credential: Any, secrets: set[str]) -> databases.Where:
    return databases.Where(credential, call.execution_id, call.store_key, secrets, call.timeout)


def _open_source(
    plan: TransferPlan, call: ToolCall, credential: Any, secrets: set[str], stack: contextlib.ExitStack
) -> Iterator[Chunk]:
    source, size, strict = plan.source, plan.chunk_size, plan.mapping is None
    if source.type in SQL_TYPES:
        conn = stack.enter_context(_database(source, _where(call, credential, secrets)))
        return databases.read_chunks(conn, source, size)
    if source.type == "http":
        return web.read_chunks(source, web.auth_headers(credential, secrets), size, strict)
    fmt = formats.format_of(source)
    stream = stack.enter_context(streams.open_stream(formats.location_of(source), "rb", credential))
    return formats.read_chunks(stream, fmt, size, strict, "source")


def _open_target(
    plan: TransferPlan, call: ToolCall, credential: Any, secrets: set[str], stack: contextlib.ExitStack
) -> Any:
    target = plan.target
    if target.type in SQL_TYPES:
        conn = stack.enter_context(_database(target, _where(call, credential, secrets)))
        writer = databases.TableWriter(conn, plan)
        writer.start()
        return writer
    if target.type == "http":
        return web.HttpWriter(target, web.auth_headers(credential, secrets))
    fmt = formats.format_of(target)
    stream = stack.enter_context(streams.open_stream(formats.location_of(target), "wb", credential))
    return formats.FileWriter(stream, fmt)


@contextlib.contextmanager
def _database(endpoint: Endpoint, where: databases.Where) -> Iterator[Any]:
    """An open connection, rolled back when the copy fails and closed after it."""
    conn = databases.connect(endpoint, where)
    try:
        yield conn
    except BaseException:
        with contextlib.suppress(Exception):
            conn.rollback()
        raise
    finally:
        with contextlib.suppress(Exception):
            conn.close()


def _target_name(target: Endpoint) -> str | None:
    if target.type in SQL_TYPES:
        return target.text("table") or "custom_query"
    if target.type == "http":
        return target.text("url", "endpoint")
    return formats.location_of(target)
