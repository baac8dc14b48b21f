"""The OpenAPI 3.1 document of the REST API, served at /api/openapi.json, built from the routes it
is given (api.api_routes: each path pattern and its handler; this module imports no route) and
the pydantic models of models.py that each handler names in its `doc` (method -> models.Op):
nothing is written here by hand but the errors' descriptions.

A route's path parameters are named after its handler method's parameters and constrained by
the route's own pattern (an id: 1 to 19 digits); alternatives in a pattern, `(pause|resume)`,
become one path each. Responses every route can give are added: 400 for a bad body or query,
401/403 for a write (a Bearer token), 404 for a path naming something, 413 for a body, 503 when
the store or the broker cannot be reached.
"""

from __future__ import annotations

import inspect
import re
from collections.abc import Iterator
from typing import Any

from pydantic import BaseModel, TypeAdapter

from noetl_celery import __version__
from noetl_celery.dashboard import models

JSON = "application/json"
REF = "#/components/schemas/{model}"
ERRORS = {
    400: "a bad body or parameter; `field` names it",
    401: "no or a wrong Bearer token",
    403: "writes are disabled (no NOETL_DASHBOARD_TOKEN on the server)",
    404: "no such route, execution, attempt, catalog path or schedule",
    409: "refused by the engine (it says why)",
    413: "the body is larger than NOETL_API_MAX_BODY_BYTES",
    501: "not offered by this server",
    503: "no worker runs executions here, or the broker or the event store cannot be reached",
}
READS = ("get", "head", "options")
METHODS = ("get", "post", "put", "patch", "delete")
ID_PATTERN = r"^[0-9]{1,19}$"


def split_pattern(pattern: str) -> list[tuple[bool, str]]:
    """A route's regex as (is_group, text) parts: literal text and its top-level groups."""
    parts: list[tuple[bool, str]] = []
    depth, start = 0, 0
    literal: list[str] = []
    for i, ch in enumerate(pattern):
        if ch == "(" and (i == 0 or pattern[i - 1] != "\\"):
            if depth == 0:
                parts.append((False, "".join(literal)))
                literal, start = [], i + 1
            depth += 1
        elif ch == ")" and pattern[i - 1] != "\\":
            depth -= 1
            if depth == 0:
                parts.append((True, pattern[start:i]))
        elif depth == 0:
            literal.append(ch)
    parts.append((False, "".join(literal)))
    return [(g, re.sub(r"\\(.)", r"\1", t) if not g else t) for g, t in parts if g or t]


def _alternatives(group: str) -> list[str] | None:
    """`pause|resume` -> ["pause", "resume"]; None for a group that is not a list of words."""
    words = group.split("|")
    return words if len(words) > 1 and all(re.fullmatch(r"[A-Za-z_-]+", w) for w in words) else None


def expand(pattern: str, names: list[str]) -> Iterator[tuple[str, list[dict[str, Any]]]]:
    """(OpenAPI path, path parameters) of a route pattern; `names` are its handler's parameters."""
    paths: list[tuple[str, list[dict[str, Any]]]] = [("", [])]
    names = list(names)
    for is_group, text in split_pattern(pattern):
        if not is_group:
            paths = [(p + text, params) for p, params in paths]
            continue
        name = names.pop(0) if names else "value"
        words = _alternatives(text)
        if words is not None:
            paths = [(p + w, params) for p, params in paths for w in words]
            continue
        regex = ID_PATTERN if text == r"\d+" else f"^{text}$"
        param = {"name": name, "in": "path", "required": True, "schema": {"type": "string", "pattern": regex}}
        paths = [(p + "{" + name + "}", [*params, param]) for p, params in paths]
    yield from paths


class Schemas:
    """The components/schemas of the document, filled as models are referred to."""

    def __init__(self) -> None:
        self.components: dict[str, Any] = {}

    def of(self, kind: Any) -> dict[str, Any]:
        schema = TypeAdapter(kind).json_schema(ref_template=REF)
        self.components.update(schema.pop("$defs", {}))
        if isinstance(kind, type) and issubclass(kind, BaseModel):
            self.components[kind.__name__] = schema
            return {"$ref": REF.format(model=kind.__name__)}
        return schema


def _non_null(schema: dict[str, Any]) -> dict[str, Any]:
    """A query parameter's schema without the `null` branch of an optional field."""
    branches = [s for s in schema.get("anyOf", []) if s.get("type") != "null"]
    if len(branches) == 1:
        extra = {k: v for k, v in schema.items() if k not in ("anyOf", "default", "title")}
        return {**branches[0], **extra}
    return {k: v for k, v in schema.items() if k not in ("default", "title")}


def query_parameters(query: type[BaseModel]) -> list[dict[str, Any]]:
    schema = query.model_json_schema()
    required = set(schema.get("required", ()))
    return [
        {"name": name, "in": "query", "required": name in required, "schema": _non_null(prop)}
        for name, prop in schema["properties"].items()
    ]


def _answer(description: str, schema: dict[str, Any]) -> dict[str, Any]:
    return {"description": description, "content": {JSON: {"schema": schema}}}


def operation(
    schemas: Schemas, handler: type, method: str, op: models.Op, path: str, params: list[dict[str, Any]]
) -> dict[str, Any]:
    write = method not in READS and method.upper() not in getattr(handler, "open_methods", frozenset())
    codes = set(op.errors)
    if op.body is not None or op.query is not None:
        codes.add(400)
    if op.body is not None:
        codes.add(413)
    if write:
        codes |= {401, 403, 413}
    if params:
        codes.add(404)
    if path not in ("/health", "/api/health"):
        codes.add(503)
    responses: dict[str, Any] = {str(op.status): _answer("success", schemas.of(op.answer))}
    for status, model, description in op.extra_answers:
        responses[str(status)] = _answer(description, schemas.of(model))
    error = schemas.of(models.Error)
    for code in sorted(codes):
        responses.setdefault(str(code), _answer(ERRORS[code], error))
    result: dict[str, Any] = {
        "summary": op.summary,
        "operationId": f"{method}_{re.sub(r'[^A-Za-z0-9]+', '_', path).strip('_')}",
        "parameters": params + (query_parameters(op.query) if op.query is not None else []),
        "responses": responses,
    }
    if op.body is not None:
        result["requestBody"] = {"required": op.body_required, "content": {JSON: {"schema": schemas.of(op.body)}}}
    if write:
        result["security"] = [{"bearer": []}]
    return result


def document(routes: list[tuple[str, type]]) -> dict[str, Any]:
    """The document of `routes` (api.api_routes: each path pattern and its handler)."""
    schemas = Schemas()
    paths: dict[str, dict[str, Any]] = {}
    for pattern, handler in routes:
        for method, op in getattr(handler, "doc", {}).items():
            names = list(inspect.signature(getattr(handler, method)).parameters)[1:]
            for path, params in expand(pattern, names):
                paths.setdefault(path, {})[method] = operation(schemas, handler, method, op, path, params)
    return {
        "openapi": "3.1.0",
        "info": {
            "title": "noetl-celery REST API",
            "version": __version__,
            "description": (
                "NoETL's routes with NoETL's shapes, so that NoETL's client and GUI drive this engine. "
                "Reads are open; writes need `Authorization: Bearer <NOETL_DASHBOARD_TOKEN>`. Ids are strings."
            ),
        },
        "components": {
            "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}},
            "schemas": schemas.components,
        },
        "paths": dict(sorted(paths.items())),
    }
