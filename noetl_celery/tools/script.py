"""`script:` — code for the python and postgres tools read from somewhere else than `code:`/`command:`.

Shape (NoETL's): `script: {uri?, path?, source: {type, code?, path?, endpoint?, bucket?, region?,
auth?}}`. Decides which source types are read and how: inline: `source.code`; file: `uri` or
`source.path`, relative to the playbook file's folder or absolute; http/https: a GET of
`source.endpoint` when given, as NoETL does, else of `uri`; gcs/s3: the object `uri`
(gs://bucket/name, s3://bucket/key), or `source.bucket` with the key in `path`, `source.path` or
`uri`, read with the credential `source.auth` names (tools/object_store.py; `source.region`,
`source.endpoint_url`, `source.project` as the s3/gcs tools take them). A gcs/s3 source whose
client library is missing is refused at validate naming the extra to install; an unknown type
is refused with the same message at validate (literal values) and in the worker.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel, ConfigDict, ValidationError, field_validator, model_validator

from noetl_celery.config import credentials, secret_registry
from noetl_celery.core.errors import CredentialError
from noetl_celery.core.lazy import lazy_module
from noetl_celery.tools import object_store

if TYPE_CHECKING:
    import requests
else:  # imported on the first fetch: a command that only reads a playbook starts without it
    requests = lazy_module("requests")

SCRIPT_HTTP_TIMEOUT = 30.0  # seconds for fetching a script over http(s)
SCRIPT_MAX_BYTES = 5 * 1024 * 1024  # a script larger than this is refused
SOURCE_TYPES = ("inline", "file", "http", "https", "gcs", "s3")
BUCKET_SCHEMES = {"gcs": "gs", "s3": "s3"}  # source type -> the object store's scheme


class ScriptError(Exception):
    """The script cannot be read (its message names the source and why)."""


class ScriptSource(BaseModel):
    model_config = ConfigDict(extra="allow")

    type: str = "file"
    code: str | None = None
    path: str | None = None
    endpoint: str | None = None  # http/https: the URL to GET (NoETL's spelling), before `uri`
    bucket: str | None = None  # gcs/s3: the bucket; the key is `path` (script's or source's) or `uri`
    region: str | None = None  # s3
    endpoint_url: str | None = None  # gcs/s3: a custom endpoint (an emulator, MinIO)
    project: str | None = None  # gcs
    auth: Any = None  # gcs/s3: the credential (a name or a mapping, as a task's `auth:`)

    @field_validator("type")
    @classmethod
    def _known_type(cls, value: str) -> str:
        if "{{" in value:  # rendered in the worker, checked again there
            return value
        if value in BUCKET_SCHEMES:
            missing = object_store.missing_extra(BUCKET_SCHEMES[value])
            if missing is not None:
                raise ValueError(f"script source type '{value}': {missing}")
        if value not in SOURCE_TYPES:
            raise ValueError(f"script source type '{value}' is unknown; use one of {', '.join(SOURCE_TYPES)}")
        return value


class Script(BaseModel):
    model_config = ConfigDict(extra="allow")

    uri: str | None = None
    path: str | None = None  # NoETL's other spelling of the script's location (the object key for gcs/s3)
    source: ScriptSource | None = None

    @model_validator(mode="after")
    def _something_to_read(self) -> Script:
        kind = self.source.type if self.source else "file"
        if kind == "inline" and self.source is not None and self.source.code is None:
            raise ValueError("an inline script needs source.code")
        if kind in BUCKET_SCHEMES:
            has_key = self.path or self.uri or (self.source and self.source.path)
            names_object = self.uri and ("://" in self.uri or "{{" in self.uri)  # a template: checked rendered
            if not names_object and not (self.source and self.source.bucket and has_key):
                raise ValueError(
                    f"a {kind} script needs uri ({BUCKET_SCHEMES[kind]}://bucket/key), or source.bucket and path"
                )
        elif kind != "inline" and not (
            self.uri or self.path or (self.source and (self.source.path or self.source.endpoint))
        ):
            raise ValueError(f"a {kind} script needs uri (or source.path, or source.endpoint for http)")
        return self


def load(script: dict[str, Any], source_file: str | None) -> str:
    """The text of a rendered `script:` mapping (raises ScriptError)."""
    try:
        parsed = Script.model_validate(script)
    except ValidationError as exc:  # a rendered value the literal check could not see
        raise ScriptError("; ".join(str(e.get("msg")) for e in exc.errors())) from None
    source = parsed.source or ScriptSource()
    if source.type == "inline":
        return source.code or ""
    if source.type in ("http", "https") and source.endpoint:
        return _fetch(source.endpoint)  # NoETL fetches `source.endpoint`; `uri` then only names the script
    where = source.path or parsed.uri or ""
    if source.type in ("http", "https") or where.startswith(("http://", "https://")):
        return _fetch(where)
    if source.type in BUCKET_SCHEMES:
        return _read_object(parsed, source)
    return _read_file(where or parsed.path or "", source_file)


def _read_object(script: Script, source: ScriptSource) -> str:
    scheme = BUCKET_SCHEMES[source.type]
    if script.uri and "://" in script.uri:
        uri = script.uri
    elif source.bucket:
        key = str(script.path or source.path or script.uri or "").lstrip("/")
        uri = f"{scheme}://{source.bucket}/{key}"
    else:
        raise ScriptError(f"a {source.type} script needs uri ({scheme}://bucket/key), or source.bucket and path")
    if not uri.startswith(f"{scheme}://"):
        raise ScriptError(f"script {uri}: a {source.type} source reads {scheme}:// objects")
    try:
        credential = credentials.resolve(source.auth) if source.auth else None
    except CredentialError as exc:
        raise ScriptError(f"script {uri}: {exc}") from None
    if credential is not None:
        secret_registry.register(credential)  # masked in all the attempt writes from now on
    options = {
        k: v
        for k, v in (("region", source.region), ("endpoint_url", source.endpoint_url), ("project", source.project))
        if v
    }
    try:
        body = object_store.get_bytes(uri, credential, max_bytes=SCRIPT_MAX_BYTES, **options)
    except object_store.ObjectTooLarge:
        raise ScriptError(f"script {uri} is larger than {SCRIPT_MAX_BYTES} bytes") from None
    except object_store.ObjectStoreError as exc:
        raise ScriptError(f"script ({source.type} source) cannot be read: {exc}") from None
    try:
        return body.decode("utf-8")
    except UnicodeDecodeError:
        raise ScriptError(f"script {uri} is not UTF-8 text") from None


def _read_file(where: str, source_file: str | None) -> str:
    path = Path(where).expanduser()
    if not path.is_absolute():
        base = Path(source_file).resolve().parent if source_file else Path.cwd()
        path = base / path
    try:
        if path.stat().st_size > SCRIPT_MAX_BYTES:
            raise ScriptError(f"script file {path} is larger than {SCRIPT_MAX_BYTES} bytes")
        return path.read_text(encoding="utf-8")
    except OSError as exc:
        raise ScriptError(f"script file {path} cannot be read: {exc.strerror or exc}") from None


def _fetch(url: str) -> str:
    try:
        response = requests.get(url, timeout=SCRIPT_HTTP_TIMEOUT)
    except requests.RequestException as exc:
        raise ScriptError(f"script {url} cannot be fetched: {type(exc).__name__}: {exc}") from None
    if response.status_code >= 400:
        raise ScriptError(f"script {url} cannot be fetched: HTTP {response.status_code}")
    if len(response.content) > SCRIPT_MAX_BYTES:
        raise ScriptError(f"script {url} is larger than {SCRIPT_MAX_BYTES} bytes")
    return response.text
