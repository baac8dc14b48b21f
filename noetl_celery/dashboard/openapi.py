"""The OpenAPI 3.1 document of the REST API (api.py), served at /api/openapi.json."""

from __future__ import annotations

from typing import Any

from noetl_celery import __version__
from noetl_celery.dashboard.api import STATUSES
from noetl_celery.dashboard.schedules_api import schedule_paths

JSON = "application/json"
BEARER: list[dict[str, list[str]]] = [{"bearer": []}]


def _object(properties: dict[str, Any], required: list[str] | None = None) -> dict[str, Any]:
    schema: dict[str, Any] = {"type": "object", "properties": properties}
    if required:
        schema["required"] = required
    return schema


def _body(schema: dict[str, Any], required: bool = True) -> dict[str, Any]:
    return {"required": required, "content": {JSON: {"schema": schema}}}


def _ok(description: str, schema: dict[str, Any] | None = None) -> dict[str, Any]:
    return {"description": description, "content": {JSON: {"schema": schema or {"type": "object"}}}}


ERROR = {"$ref": "#/components/schemas/Error"}


def _errors(*codes: int) -> dict[str, Any]:
    text = {
        400: "a bad body or parameter; `field` names it",
        401: "no or a wrong Bearer token",
        403: "writes are disabled (no NOETL_DASHBOARD_TOKEN on the server)",
        404: "no such execution, catalog path or schedule",
        409: "refused by the engine",
        501: "not offered by this server",
        503: "no worker, or the broker or the event store cannot be reached",
    }
    return {str(c): {"description": text[c], "content": {JSON: {"schema": ERROR}}} for c in codes}


WRITE = (400, 401, 403)
EXECUTION_ID = {"name": "execution_id", "in": "path", "required": True, "schema": {"type": "integer"}}
WORKLOAD = {
    "type": "object",
    "description": "deep-merged over the playbook's workload, as `--set` does (a dotted key names a nested value)",
}


CONTENT = {
    "type": "object",
    "properties": {"content": {"type": "string", "contentEncoding": "base64"}, "workload": WORKLOAD},
    "required": ["content"],
}


def _rerun(started: dict[str, Any]) -> dict[str, Any]:
    """POST /api/executions/{id}/rerun: NoETL's body, and the project's from_step and latest."""
    body = _object(
        {
            "workload": {**WORKLOAD, "description": "deep-merged over the OLD execution's workload"},
            "resource_kind": {"type": "string", "enum": ["playbook"]},
            "from_step": {
                "type": "string",
                "description": "start at this step; the steps that completed before its last run keep their "
                "results (copied, not run). Absent: the whole playbook runs again",
            },
            "latest": {
                "type": "boolean",
                "description": "the playbook registered at the execution's catalog path now, not its stored plan",
            },
        }
    )
    answer = {
        **started,
        "properties": {
            **started["properties"],
            "rerun_of": {"type": "integer"},
            "from_step": {"type": ["string", "null"]},
            "latest": {"type": "boolean"},
        },
    }
    return {
        "post": {
            "summary": "A new execution made from this one (noetl-celery rerun): whole, or from a step; "
            "with changed parameters, or the latest registered version",
            "security": BEARER,
            "parameters": [EXECUTION_ID],
            "requestBody": _body(body, required=False),
            "responses": {"200": _ok("started", answer), **_errors(*WRITE, 404, 409, 503)},
        }
    }


def document() -> dict[str, Any]:
    started = _object(
        {
            "execution_id": {"type": "integer"},
            "status": {"type": "string"},
            "path": {"type": "string"},
            "playbook": {"type": "string"},
        },
        ["execution_id", "status"],
    )
    return {
        "openapi": "3.1.0",
        "info": {
            "title": "noetl-celery REST API",
            "version": __version__,
            "description": (
                "NoETL's routes with NoETL's shapes, so that NoETL's client drives this engine. Reads "
                "are open; writes need `Authorization: Bearer <NOETL_DASHBOARD_TOKEN>`."
            ),
        },
        "components": {
            "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}},
            "schemas": {
                "Error": _object({"detail": {"type": "string"}, "field": {"type": "string"}}, ["detail"]),
            },
        },
        "paths": {
            "/health": {"get": {"summary": "Liveness: the process answers", "responses": {"200": _ok("alive")}}},
            "/ready": {
                "get": {
                    "summary": "Readiness: the event store answers at the schema head and the broker is reachable",
                    "responses": {"200": _ok("ready"), "503": _ok("unready: the part that is down")},
                }
            },
            "/api/openapi.json": {"get": {"summary": "This document", "responses": {"200": _ok("OpenAPI 3.1")}}},
            "/api/catalog/register": {
                "post": {
                    "summary": "Validate a playbook and register it under its metadata.path",
                    "security": BEARER,
                    "requestBody": _body(
                        _object(
                            {
                                "content": {"type": "string", "contentEncoding": "base64"},
                                "resource_type": {"type": "string", "enum": ["Playbook", "Credential"]},
                            },
                            ["content"],
                        )
                    ),
                    "responses": {"200": _ok("registered"), **_errors(*WRITE, 501)},
                }
            },
            "/api/catalog/list": {
                "post": {
                    "summary": "The registered playbooks",
                    "requestBody": _body(_object({"resource_type": {"type": "string"}}), required=False),
                    "responses": {
                        "200": _ok(
                            "entries by path",
                            _object({"entries": {"type": "array", "items": {"type": "object"}}}, ["entries"]),
                        ),
                        **_errors(400),
                    },
                }
            },
            "/api/execute": {
                "post": {
                    "summary": "Start a registered playbook by its catalog path",
                    "security": BEARER,
                    "requestBody": _body(
                        _object(
                            {
                                "path": {"type": "string"},
                                "workload": WORKLOAD,
                                "payload": {**WORKLOAD, "description": "older clients' name of workload"},
                                "resource_kind": {"type": "string", "enum": ["playbook"]},
                                "version": {"type": ["integer", "string"]},
                            },
                            ["path"],
                        )
                    ),
                    "responses": {"200": _ok("started", started), **_errors(*WRITE, 404, 503)},
                }
            },
            "/api/executions/{execution_id}": {
                "get": {
                    "summary": "An execution and one page of its events, newest first",
                    "parameters": [
                        EXECUTION_ID,
                        {"name": "page", "in": "query", "schema": {"type": "integer", "minimum": 1}},
                        {
                            "name": "page_size",
                            "in": "query",
                            "schema": {"type": "integer", "minimum": 1, "maximum": 1000},
                        },
                    ],
                    "responses": {"200": _ok("the execution"), **_errors(400, 404)},
                }
            },
            "/api/executions/{execution_id}/status": {
                "get": {
                    "summary": "`noetl-celery status --json`, with NoETL's completed/failed/current_step fields",
                    "parameters": [EXECUTION_ID],
                    "responses": {"200": _ok("the status"), **_errors(404)},
                }
            },
            "/api/executions/{execution_id}/cancel": {
                "post": {
                    "summary": "Cancel a running execution and its running children",
                    "security": BEARER,
                    "parameters": [EXECUTION_ID],
                    "requestBody": _body(
                        _object({"cascade": {"type": "boolean"}, "reason": {"type": "string"}}), required=False
                    ),
                    "responses": {
                        "200": _ok(
                            "cancelled",
                            _object({"cancelled_executions": {"type": "array", "items": {"type": "string"}}}),
                        ),
                        **_errors(*WRITE, 404),
                    },
                }
            },
            "/api/executions/{execution_id}/rerun": _rerun(started),
            "/api/executions/cleanup": {
                "post": {
                    "summary": "Cancel top-level executions running for longer than older_than_minutes",
                    "security": BEARER,
                    "requestBody": _body(
                        _object({"older_than_minutes": {"type": "number"}, "dry_run": {"type": "boolean"}}),
                        required=False,
                    ),
                    "responses": {"200": _ok("the executions found"), **_errors(*WRITE)},
                }
            },
            "/api/validate": {
                "post": {
                    "summary": "`noetl-celery validate` of a playbook body",
                    "security": BEARER,
                    "requestBody": _body(CONTENT),
                    "responses": {"200": _ok("valid"), **_errors(*WRITE)},
                }
            },
            "/api/compile": {
                "post": {
                    "summary": "`noetl-celery compile --json` of a playbook body: its steps as task signatures",
                    "security": BEARER,
                    "requestBody": _body(CONTENT),
                    "responses": {"200": _ok("the plan described"), **_errors(*WRITE)},
                }
            },
            "/api/submit": {
                "post": {
                    "summary": "`noetl-celery submit` of a playbook body, without registering it",
                    "security": BEARER,
                    "requestBody": _body(CONTENT),
                    "responses": {"200": _ok("started", started), **_errors(*WRITE, 503)},
                }
            },
            "/api/executions": {
                "get": {
                    "summary": "`noetl-celery executions --json`: the most recent executions, newest first",
                    "parameters": [
                        {"name": "status", "in": "query", "schema": {"type": "string", "enum": list(STATUSES)}},
                        {"name": "playbook", "in": "query", "schema": {"type": "string"}},
                        {"name": "limit", "in": "query", "schema": {"type": "integer", "minimum": 1, "maximum": 1000}},
                    ],
                    "responses": {"200": _ok("executions"), **_errors(400)},
                }
            },
            "/api/executions/{execution_id}/events": {
                "get": {
                    "summary": "`noetl-celery events ID --json`: event rows in id order, filtered",
                    "parameters": [
                        EXECUTION_ID,
                        {"name": "after", "in": "query", "schema": {"type": "integer"}},
                        {"name": "type", "in": "query", "schema": {"type": "array", "items": {"type": "string"}}},
                        {"name": "step", "in": "query", "schema": {"type": "array", "items": {"type": "string"}}},
                        {"name": "limit", "in": "query", "schema": {"type": "integer", "minimum": 1, "maximum": 10000}},
                    ],
                    "responses": {"200": _ok("events and next_after"), **_errors(400, 404)},
                }
            },
            "/api/executions/{execution_id}/resume": {
                "post": {
                    "summary": "`noetl-celery resume ID`: continue a failed or cancelled execution",
                    "security": BEARER,
                    "parameters": [EXECUTION_ID],
                    "responses": {"200": _ok("resumed"), **_errors(*WRITE, 404, 409, 503)},
                }
            },
            "/api/credentials": {
                "get": {
                    "summary": "None are kept here: an empty list (credentials come from NOETL_AUTH_* on the workers)",
                    "responses": {"200": _ok("{items: []}")},
                },
                "post": {
                    "summary": "Not offered: credentials come from NOETL_AUTH_* on the workers",
                    "responses": _errors(501),
                },
            },
            "/api/executions/{execution_id}/stop": {
                "post": {
                    "summary": "NoETL's GUI's stop: the same as cancel",
                    "security": BEARER,
                    "parameters": [EXECUTION_ID],
                    "responses": {"200": _ok("cancelled"), **_errors(*WRITE, 404)},
                }
            },
            "/api/executions/{execution_id}/attempts": {
                "get": {
                    "summary": "The attempts in the order they ended, numbered from 1 (n)",
                    "parameters": [EXECUTION_ID],
                    "responses": {"200": _ok("{attempts}"), **_errors(400, 404)},
                }
            },
            "/api/executions/{execution_id}/attempts/{n}/log": {
                "get": {
                    "summary": "What attempt n wrote: stdout, stderr, logging lines, and its error",
                    "parameters": [
                        EXECUTION_ID,
                        {"name": "n", "in": "path", "required": True, "schema": {"type": "integer"}},
                    ],
                    "responses": {"200": _ok("the attempt's output"), **_errors(404)},
                }
            },
            "/api/dashboard/stats": {
                "get": {
                    "summary": "Counts for NoETL's GUI: playbooks, executions, running, success rate, recent ones",
                    "responses": {"200": _ok("the counts")},
                }
            },
            "/api/catalog/resource": {
                "post": {
                    "summary": "One catalog entry with its YAML content and payload (the YAML as an object)",
                    "requestBody": _body(
                        _object(
                            {
                                "path": {"type": "string"},
                                "catalog_id": {"type": "string"},
                                "version": {"type": ["string", "integer"]},
                            }
                        )
                    ),
                    "responses": {"200": _ok("the entry"), **_errors(400, 404)},
                }
            },
            "/api/catalog/playbook/content": {
                "get": {
                    "summary": "A catalog entry's YAML by its catalog id (its path)",
                    "parameters": [
                        {"name": "playbook_id", "in": "query", "required": True, "schema": {"type": "string"}}
                    ],
                    "responses": {"200": _ok("{content}"), **_errors(400, 404)},
                }
            },
            "/api/catalog/playbooks/validate": {
                "post": {
                    "summary": "Validate a playbook's YAML (raw or base64): {valid, errors}",
                    "security": BEARER,
                    "requestBody": _body(CONTENT),
                    "responses": {"200": _ok("{valid, errors}"), **_errors(*WRITE)},
                }
            },
            **schedule_paths(_ok, _errors, _body, _object, BEARER, WRITE),
        },
    }
