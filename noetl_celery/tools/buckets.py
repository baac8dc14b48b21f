"""The `gcs` and `s3` tools: NoETL's upload of a local file to a bucket, and the object operations
a playbook needs around it, on Google Cloud Storage and S3 (tools/object_store.py does the I/O).

NoETL's form (no `action`, or `action: upload`): `source` (a local file; relative to the
playbook's folder), `destination` (gs://bucket/name or s3://bucket/key; a destination ending in
"/" or naming only the bucket gets the file's name), optional `content_type`, `metadata`.
Data: {status: success, uri, bucket, blob (gcs) | key (s3), size, content_type, message}.

Other actions (the same location keys: `uri`, or `bucket` + `key`/`blob`/`path`):
* `download`: `source` (the object; or `uri`) -> `destination` (a local file, written whole or
  not at all). Data: {status, uri, bucket, key, path, size}.
* `put`: `content` (a string, written as UTF-8) or `data` (any value, written as JSON) to
  `destination`/`uri`. Data: as upload.
* `get`: the object `uri`/`source`. Data: {status, uri, bucket, key, size, content_type,
  content (text; `encoding: base64` when it is not UTF-8)}, plus `data` (the parsed JSON) with
  `decode: json`. An object above `max_bytes` (default NOETL_MAX_STORED_BYTES) is refused with
  kind `too_large`; one above NOETL_MAX_RESULT_BYTES is stored by reference by the worker.
* `list`: objects under `uri` (a prefix) or `bucket` + `prefix`, at most `max_keys` (default
  1000). Data: {status, bucket, prefix, objects: [{uri, key, size, content_type, etag, updated}],
  count, truncated}.
* `delete`: Data: {status, uri, bucket, key, deleted} (deleted false when nothing was there:
  a retried delete succeeds).

Connection: `auth:` (or NoETL's `credential:`) names the credential (object_store.py lists its
keys); `endpoint_url` (S3 endpoint, or the GCS emulator's), `region` (S3) and `project` (GCS) in
the task override the credential's. Secrets never reach the result or an error message.
Errors: kind not_found, authorization, credential, connection and timeout (retryable), invalid_args,
too_large or object_store.
"""

from __future__ import annotations

import base64
import json
import mimetypes
from pathlib import Path
from typing import Any, Literal

from noetl_celery.config import limits
from noetl_celery.core.vocabulary import ToolErrorKind
from noetl_celery.tools import object_store
from noetl_celery.tools.base import Outcome, ToolCall, register
from noetl_celery.tools.object_store import CallRefused

ACTIONS = ("upload", "download", "put", "get", "list", "delete")
DEFAULT_MAX_KEYS = 1000
_KEY_FIELDS = ("key", "blob", "path")
FIELDS = {
    "action",
    "source",
    "destination",
    "uri",
    "bucket",
    "key",
    "blob",
    "path",
    "prefix",
    "content",
    "data",
    "content_type",
    "metadata",
    "decode",
    "max_bytes",
    "max_keys",
    "endpoint_url",
    "region",
    "project",
    "credential",
}


class BucketSettings(object_store.ObjectStoreSettings):
    action: Literal["upload", "download", "put", "get", "list", "delete"] | None = None
    source: str | None = None
    destination: str | None = None
    uri: str | None = None
    bucket: str | None = None
    key: str | None = None
    blob: str | None = None
    prefix: str | None = None
    content: str | None = None
    metadata: dict[str, Any] | None = None
    decode: Literal["auto", "text", "json", "base64"] | None = None
    max_keys: int | None = None


class _Bucket:
    """One call of the gcs or s3 tool: the scheme it works on and the call's settings."""

    def __init__(self, scheme: str, call: ToolCall) -> None:
        self.scheme = scheme  # "gs" or "s3"
        self.kind = call.kind
        self.cfg = call.config
        self.credential = call.credential
        self.base = str(Path(call.source_file).resolve().parent) if call.source_file else None
        self.options = {k: self.cfg[k] for k in ("endpoint_url", "region", "project") if self.cfg.get(k)}
        if call.timeout:
            self.options["timeout"] = call.timeout

    # -- locations

    def object_uri(self, *keys: str) -> str:
        """The object the call names: the first of `keys` given, else `bucket` + key."""
        for name in keys:
            value = self.cfg.get(name)
            if value:
                return self.checked(str(value), name)
        bucket = self.cfg.get("bucket")
        key = next((self.cfg[k] for k in _KEY_FIELDS if self.cfg.get(k)), None)
        if bucket and key:
            return f"{self.scheme}://{bucket}/{str(key).lstrip('/')}"
        wanted = " or ".join(f"`{k}`" for k in keys)
        raise CallRefused(f"{self.kind}: give {wanted} ({self.scheme}://bucket/key), or `bucket` and `key`")

    def checked(self, uri: str, field: str) -> str:
        loc = object_store.parse(uri)
        if loc.scheme != self.scheme:
            raise CallRefused(f"{self.kind}: {field} {uri!r} is not a {self.scheme}:// location")
        return loc.uri

    def local(self, field: str) -> str:
        value = self.cfg.get(field)
        if not value:
            raise CallRefused(f"{self.kind}: give `{field}` (a local file)")
        if "://" in str(value) and not str(value).startswith("file://"):
            raise CallRefused(f"{self.kind}: {field} {value!r} must be a local file")
        return object_store.parse(str(value), self.base).key

    def parts(self, uri: str) -> dict[str, Any]:
        loc = object_store.parse(uri)
        return {"uri": uri, "bucket": loc.bucket, ("blob" if self.scheme == "gs" else "key"): loc.key}

    # -- actions

    def upload(self) -> dict[str, Any]:
        path = self.local("source")
        target = self.object_uri("destination", "uri")
        if target.endswith("/") or not object_store.parse(target).key:
            target = target.rstrip("/") + "/" + Path(path).name
        content_type = self.cfg.get("content_type") or mimetypes.guess_type(path)[0]
        info = object_store.upload_file(
            path, target, self.credential, content_type, self.cfg.get("metadata"), **self.options
        )
        return self.written(target, info.size, content_type)

    def written(self, target: str, size: int | None, content_type: str | None) -> dict[str, Any]:
        return {
            "status": "success",
            **self.parts(target),
            "size": size,
            "content_type": content_type,
            "message": f"Uploaded {size} bytes to {target}",
        }

    def put(self) -> dict[str, Any]:
        target = self.object_uri("destination", "uri")
        if self.cfg.get("content") is not None:
            body, default_type = str(self.cfg["content"]).encode("utf-8"), "text/plain"
        elif "data" in self.cfg:
            body, default_type = json.dumps(self.cfg["data"]).encode("utf-8"), "application/json"
        else:
            raise CallRefused(f"{self.kind}: put needs `content` (text) or `data` (a value written as JSON)")
        content_type = self.cfg.get("content_type") or default_type
        info = object_store.put_bytes(
            target, body, self.credential, content_type, self.cfg.get("metadata"), **self.options
        )
        return self.written(target, info.size, content_type)

    def download(self) -> dict[str, Any]:
        source = self.object_uri("source", "uri")
        path = self.local("destination")
        size = object_store.download_file(source, path, self.credential, **self.options)
        return {"status": "success", **self.parts(source), "path": path, "size": size}

    def get(self) -> dict[str, Any]:
        source = self.object_uri("uri", "source")
        limit = int(self.cfg.get("max_bytes") or limits.max_stored_bytes())
        info = object_store.stat(source, self.credential, **self.options)
        if info.size is not None and info.size > limit:
            raise object_store.ObjectTooLarge(_too_large(source, info.size, limit))
        try:
            body = object_store.get_bytes(source, self.credential, max_bytes=limit, **self.options)
        except object_store.ObjectTooLarge:
            raise object_store.ObjectTooLarge(_too_large(source, None, limit)) from None
        result = {"status": "success", **self.parts(source), "size": len(body), "content_type": info.content_type}
        result.update(decoded(body, str(self.cfg.get("decode") or "auto"), source))
        return result

    def list(self) -> dict[str, Any]:
        prefix_uri = self.cfg.get("uri") or self.cfg.get("source")
        if prefix_uri:
            prefix_uri = self.checked(str(prefix_uri), "uri")
        elif self.cfg.get("bucket"):
            prefix_uri = f"{self.scheme}://{self.cfg['bucket']}/{self.cfg.get('prefix') or ''}"
        else:
            raise CallRefused(f"{self.kind}: list needs `uri` ({self.scheme}://bucket/prefix) or `bucket`")
        limit = int(self.cfg.get("max_keys") or DEFAULT_MAX_KEYS)
        found, truncated = object_store.list_objects(prefix_uri, self.credential, limit, **self.options)
        loc = object_store.parse(prefix_uri)
        objects = [info.to_dict() for info in found]
        return {
            "status": "success",
            "bucket": loc.bucket,
            "prefix": loc.key,
            "objects": objects,
            "count": len(objects),
            "truncated": truncated,
        }

    def delete(self) -> dict[str, Any]:
        target = self.object_uri("uri", "destination", "source")
        deleted = object_store.delete(target, self.credential, **self.options)
        return {"status": "success", **self.parts(target), "deleted": deleted}


def _too_large(uri: str, size: int | None, limit: int) -> str:
    held = f"{size} bytes" if size is not None else f"more than {limit} bytes"
    return (
        f"{uri} holds {held}, above the {limit} bytes a result may hold (max_bytes, or "
        "NOETL_MAX_STORED_BYTES); copy it to a file with `action: download` instead"
    )


def decoded(body: bytes, decode: str, source: str) -> dict[str, Any]:
    """The body as result fields: content (+ encoding), or data for JSON."""
    if decode == "base64":
        return {"content": base64.b64encode(body).decode("ascii"), "encoding": "base64"}
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError:
        if decode in ("text", "json"):
            raise CallRefused(f"{source} is not UTF-8 text (read it with decode: base64)") from None
        return {"content": base64.b64encode(body).decode("ascii"), "encoding": "base64"}
    if decode != "json":
        return {"content": text, "encoding": "utf-8"}
    try:
        return {"data": json.loads(text)}
    except ValueError as exc:
        raise CallRefused(f"{source} is not JSON ({exc})") from None


def run_bucket(scheme: str, call: ToolCall) -> Outcome:
    action = str(call.config.get("action") or "upload").lower()
    if action not in ACTIONS:
        return Outcome.fail(
            ToolErrorKind.INVALID_ARGS, f"{call.kind}: action {action!r} is unknown; use one of {', '.join(ACTIONS)}"
        )
    bucket = _Bucket(scheme, call)
    try:
        return Outcome.ok(getattr(bucket, action)())
    except CallRefused as exc:
        return Outcome.fail(exc.kind, str(exc))
    except object_store.ObjectStoreError as exc:
        return Outcome.fail(exc.kind, f"{call.kind} {action}: {exc}", exc.retryable)


@register("gcs", fields=FIELDS, settings=BucketSettings, extra="gcs", modules=("google.cloud.storage",))
def run_gcs(call: ToolCall) -> Outcome:
    """One operation on Google Cloud Storage (see the module docstring)."""
    return run_bucket("gs", call)


@register("s3", fields=FIELDS, settings=BucketSettings, extra="s3", modules=("boto3",))
def run_s3(call: ToolCall) -> Outcome:
    """One operation on S3 or an S3-compatible endpoint (see the module docstring)."""
    return run_bucket("s3", call)
