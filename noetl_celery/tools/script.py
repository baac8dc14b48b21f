"""`script:` — code for the python and postgres tools read from somewhere else than `code:`/`command:`.

Shape (NoETL's): `script: {uri, source: {type, code?, path?, endpoint?}}`. Decides which source
types are read (inline: `source.code`; file: `uri` or `source.path`, relative to the playbook
file's folder or absolute; http/https: a GET of `source.endpoint` when given, as NoETL does, else
of `uri`) and which are refused (gcs, s3: object stores need
cloud credentials this engine does not handle), with the same message at validate (literal
values) and in the worker.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel, ConfigDict, field_validator, model_validator

from noetl_celery.lazy import lazy_module

if TYPE_CHECKING:
    import requests
else:  # imported on the first fetch: a command that only reads a playbook starts without it
    requests = lazy_module("requests")

SCRIPT_HTTP_TIMEOUT = 30.0  # seconds for fetching a script over http(s)
SCRIPT_MAX_BYTES = 5 * 1024 * 1024  # a script larger than this is refused
SOURCE_TYPES = ("inline", "file", "http", "https")
REFUSED_SOURCES = {
    "gcs": "Google Cloud Storage",
    "s3": "Amazon S3",
}


class ScriptError(Exception):
    """The script cannot be read (its message names the source and why)."""


class ScriptSource(BaseModel):
    model_config = ConfigDict(extra="allow")

    type: str = "file"
    code: str | None = None
    path: str | None = None
    endpoint: str | None = None  # http/https: the URL to GET (NoETL's spelling), before `uri`

    @field_validator("type")
    @classmethod
    def _known_type(cls, value: str) -> str:
        if "{{" in value:  # rendered in the worker, checked again there
            return value
        if value in REFUSED_SOURCES:
            raise ValueError(
                f"script source type '{value}' ({REFUSED_SOURCES[value]}) cannot be read here: "
                f"object-store sources are not supported; use one of {', '.join(SOURCE_TYPES)}"
            )
        if value not in SOURCE_TYPES:
            raise ValueError(f"script source type '{value}' is unknown; use one of {', '.join(SOURCE_TYPES)}")
        return value


class Script(BaseModel):
    model_config = ConfigDict(extra="allow")

    uri: str | None = None
    source: ScriptSource | None = None

    @model_validator(mode="after")
    def _something_to_read(self) -> Script:
        kind = self.source.type if self.source else "file"
        if kind == "inline" and self.source is not None and self.source.code is None:
            raise ValueError("an inline script needs source.code")
        if kind != "inline" and not (self.uri or (self.source and (self.source.path or self.source.endpoint))):
            raise ValueError(f"a {kind} script needs uri (or source.path, or source.endpoint for http)")
        return self


def load(script: dict[str, Any], source_file: str | None) -> str:
    """The text of a rendered `script:` mapping (raises ScriptError)."""
    parsed = Script.model_validate(script)
    source = parsed.source or ScriptSource()
    if source.type == "inline":
        return source.code or ""
    if source.type in ("http", "https") and source.endpoint:
        return _fetch(source.endpoint)  # NoETL fetches `source.endpoint`; `uri` then only names the script
    where = source.path or parsed.uri or ""
    if source.type in ("http", "https") or where.startswith(("http://", "https://")):
        return _fetch(where)
    return _read_file(where, source_file)


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
