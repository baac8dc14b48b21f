"""The `artifact` tool: NoETL's put and get of a value in artifact storage (a local folder, S3, GCS).

`action: put` (`uri`, `data`, optional `compress`, default true as in NoETL): `data` is written
as JSON (a string as it is), gzip-compressed when `compress` (".gz" is added to the location
when it does not end so). The object appears whole or not at all, and a retried put writes the
same bytes again. Data: {status: success, uri, size_bytes (as stored), sha256 (of the
uncompressed text), compressed}.

`action: get` (the default, as in NoETL): `uri`, or `result_ref` (in the task or in its
`input:`/`args:`; a string location, or a mapping {kind: result_ref | temp_ref, ref} or {uri}).
A ".gz"/".gzip" location, or a body starting with the gzip magic bytes, is decompressed; the
text is parsed as JSON when it is JSON. Data: {status: success, data, uri, size_bytes (as
stored), compressed}. A value above `max_bytes` (default NOETL_MAX_STORED_BYTES, decompressed)
is refused with kind `too_large`, never cut; one above NOETL_MAX_RESULT_BYTES reaches the event
store by reference (the worker stores it once, docs/architecture.md "Big results").

Locations: `artifact://localfs/<absolute path>`, `artifact://<relative path>`, `file://<path>`
or a plain path are files of the worker (a relative path is under NOETL_ARTIFACT_DIR, else the
worker's current folder); `s3://bucket/key` and `gs://bucket/name` go to the object stores with
the credential `auth:` (or `credential:`) names, and `endpoint_url`/`region`/`project` as the
s3 and gcs tools take them. NoETL's own result-store locations (noetl://, eventlog://,
nats-kv://, nats-obj://) cannot be read here: a step's result is read as `{{ step_name }}`.
"""

from __future__ import annotations

import gzip
import hashlib
import io
import json
from typing import Any, Literal

from noetl_celery.config import limits
from noetl_celery.config import settings as noetl_settings
from noetl_celery.core.vocabulary import ToolErrorKind
from noetl_celery.tools import object_store
from noetl_celery.tools.base import Outcome, ToolCall, register
from noetl_celery.tools.object_store import CallRefused

LOCAL_PREFIX = "artifact://localfs/"
RESULT_STORE_SCHEMES = ("noetl", "eventlog", "nats-kv", "nats-obj")
GZIP_MAGIC = b"\x1f\x8b"


class ArtifactSettings(object_store.ObjectStoreSettings):
    action: Literal["get", "put"] | None = None
    uri: str | None = None
    result_ref: str | dict[str, Any] | None = None
    compress: bool | None = None


def location(uri: str) -> str:
    """The object_store location of an artifact URI (a local path, s3:// or gs://)."""
    scheme = uri.partition("://")[0].lower() if "://" in uri else ""
    if scheme in RESULT_STORE_SCHEMES:
        raise CallRefused(
            f"artifact {uri}: {scheme}:// names NoETL's own result store, which this engine does not have; "
            "a step's result is read here as {{ step_name }} (stored by reference above the result cap)"
        )
    if uri.startswith(LOCAL_PREFIX):
        return "/" + uri[len(LOCAL_PREFIX) :].lstrip("/")
    if scheme == "artifact":
        uri = uri[len("artifact://") :]
    if "://" in uri:
        return uri
    folder = noetl_settings.load().artifact_dir
    return object_store.parse(uri, str(folder) if folder else None).key


def _result_ref(cfg: dict[str, Any]) -> Any:
    for holder in (cfg, cfg.get("input"), cfg.get("args")):
        if isinstance(holder, dict):
            for key in ("uri", "result_ref"):
                if holder.get(key):
                    return holder[key]
    return None


def _names_empty_ref(cfg: dict[str, Any]) -> bool:
    holders = (cfg, cfg.get("input"), cfg.get("args"))
    return any(isinstance(h, dict) and "result_ref" in h and not h["result_ref"] for h in holders)


def _ref_uri(ref: Any) -> str:
    if isinstance(ref, str):
        return ref
    if isinstance(ref, dict):
        for key in ("ref", "uri", "logical_uri"):
            if isinstance(ref.get(key), str) and ref[key]:
                return ref[key]
    raise CallRefused("artifact get: result_ref must be a location or a mapping with `ref` or `uri`")


def _options(call: ToolCall) -> dict[str, Any]:
    options = {k: call.config[k] for k in ("endpoint_url", "region", "project") if call.config.get(k)}
    if call.timeout:
        options["timeout"] = call.timeout
    return options


def put(call: ToolCall) -> dict[str, Any]:
    cfg = call.config
    uri = cfg.get("uri")
    if not uri:
        raise CallRefused("artifact put needs `uri`")
    if cfg.get("data") is None:
        raise CallRefused("artifact put needs `data`")
    data = cfg["data"]
    text = data if isinstance(data, str) else json.dumps(data)
    raw = text.encode("utf-8")
    compress = cfg.get("compress", True) is not False
    body = gzip.compress(raw, mtime=0) if compress else raw  # mtime 0: a retried put writes the same bytes
    if compress and not str(uri).endswith(".gz"):
        uri = f"{uri}.gz"
    content_type = cfg.get("content_type") or ("application/gzip" if compress else "application/json")
    object_store.put_bytes(location(str(uri)), body, call.credential, content_type, **_options(call))
    shown = str(uri) if "://" in str(uri) else f"artifact://localfs{location(str(uri))}"
    return {
        "status": "success",
        "uri": shown,
        "size_bytes": len(body),
        "sha256": hashlib.sha256(raw).hexdigest(),
        "compressed": compress,
    }


def get(call: ToolCall) -> dict[str, Any]:
    ref = _result_ref(call.config)
    if ref is None and _names_empty_ref(call.config):
        raise CallRefused(
            "artifact get: result_ref rendered empty (NoETL's {{ step._ref }} names a result in NoETL's own "
            "result store, which this engine does not have); read a step's result as {{ step_name }}, or give "
            "the `uri` an artifact put returned"
        )
    if ref is None:
        raise CallRefused("artifact get needs `uri` or `result_ref`")
    uri = _ref_uri(ref)
    limit = int(call.config.get("max_bytes") or limits.max_stored_bytes())
    stored = object_store.get_bytes(location(uri), call.credential, max_bytes=limit, **_options(call))
    compressed = uri.endswith((".gz", ".gzip")) or stored[:2] == GZIP_MAGIC
    raw = _gunzip(stored, limit, uri) if compressed else stored
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise CallRefused(f"artifact {uri} is not UTF-8 text") from None
    try:
        value: Any = json.loads(text)
    except ValueError:
        value = text
    return {"status": "success", "data": value, "uri": uri, "size_bytes": len(stored), "compressed": compressed}


def _gunzip(body: bytes, limit: int, uri: str) -> bytes:
    try:
        with gzip.GzipFile(fileobj=io.BytesIO(body)) as stream:
            raw = stream.read(limit + 1)
    except (OSError, EOFError) as exc:
        raise CallRefused(f"artifact {uri} is not valid gzip: {exc}") from None
    if len(raw) > limit:
        raise object_store.ObjectTooLarge(f"artifact {uri} decompresses to more than {limit} bytes (max_bytes)")
    return raw


@register(
    "artifact",
    fields={"action", "uri", "result_ref", "data", "compress", "content_type", "max_bytes", "credential"}
    | {"endpoint_url", "region", "project"},
    settings=ArtifactSettings,
)
def run_artifact(call: ToolCall) -> Outcome:
    """Put or get one artifact (see the module docstring)."""
    action = str(call.config.get("action") or "get").lower()
    if action not in ("get", "put"):
        return Outcome.fail(ToolErrorKind.INVALID_ARGS, f"artifact: action {action!r} is unknown; use get or put")
    try:
        return Outcome.ok(put(call) if action == "put" else get(call))
    except CallRefused as exc:
        return Outcome.fail(exc.kind, str(exc))
    except object_store.ObjectStoreError as exc:
        return Outcome.fail(exc.kind, f"artifact {action}: {exc}", exc.retryable)
