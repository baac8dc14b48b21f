"""The routes NoETL's own GUI (repository noetl/gui, `src/services/api.ts`) calls beside the ones
NoETL's client calls, with the shapes its pages read: the dashboard's counts, one catalog entry
with its YAML, a playbook's content by catalog id, validation of a raw YAML text, stop, and the
credentials list (empty: credentials come from NOETL_AUTH_* on the workers).

A catalog entry's `catalog_id` here is its catalog path (the catalog keeps one registration per
path), so every route that takes a catalog id also takes the path.
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

import yaml
from sqlalchemy import func, select

from noetl_celery.core.errors import PlaybookError
from noetl_celery.dashboard import models as m
from noetl_celery.dashboard.rest import (
    CREDENTIALS_501,
    PLAYBOOK,
    Api,
    ApiError,
    listed_execution,
    optional,
    playbook_text,
)
from noetl_celery.store import repo, views
from noetl_celery.store.repo import EXECUTIONS

RECENT = 10  # executions in the dashboard's stats


def catalog_entry(row: dict[str, Any], content: str | None = None) -> dict[str, Any]:
    """A catalog row in NoETL's shape (PlaybookData of the GUI), with the project's own fields."""
    registered = row["registered_at"].isoformat() if isinstance(row["registered_at"], datetime) else None
    entry: dict[str, Any] = {
        "catalog_id": row["path"],
        "path": row["path"],
        "name": row["name"],
        "version": "1",
        "kind": PLAYBOOK,
        "resource_type": PLAYBOOK,
        "status": "active",
        "registered_at": registered,
        "created_at": registered,
        "meta": {"registered_at": registered},
        "payload": {"metadata": {"name": row["name"], "path": row["path"]}},
    }
    if content is not None:
        entry["content"] = content
        try:
            parsed = yaml.safe_load(content)
        except yaml.YAMLError:
            parsed = None
        if isinstance(parsed, dict):
            entry["payload"] = parsed
    return entry


def dashboard_stats(conn: Any) -> dict[str, Any]:
    c = EXECUTIONS.c
    counts = dict(conn.execute(select(c.status, func.count()).group_by(c.status)).all())
    ended = sum(counts.get(s, 0) for s in ("completed", "failed", "cancelled"))
    return {
        "total_playbooks": len(repo.list_playbooks(conn)),
        "total_executions": sum(counts.values()),
        "active_executions": counts.get("running", 0),
        "completed_executions": counts.get("completed", 0),
        "failed_executions": counts.get("failed", 0),
        "cancelled_executions_count": counts.get("cancelled", 0),
        # percent of the ended executions that completed
        "success_rate": round(100.0 * counts.get("completed", 0) / ended, 1) if ended else 0.0,
        "recent_executions": [listed_execution(r) for r in views.list_executions(conn, limit=RECENT)],
        "timestamp": datetime.now(UTC).isoformat(),
    }


class DashboardStats(Api):
    doc = {"get": m.Op("Counts for NoETL's GUI", m.Stats)}

    async def get(self) -> None:
        self.answer(await self.db(dashboard_stats))


def _catalog_path(body_or_args: dict[str, Any]) -> str:
    path = body_or_args.get("path") or body_or_args.get("catalog_id") or body_or_args.get("playbook_id")
    if not isinstance(path, str) or not path.strip():
        raise ApiError(400, "path: expected the catalog path (or catalog_id) of a registered playbook", "path")
    return path.strip()


class CatalogResource(Api):
    """POST /api/catalog/resource {path | catalog_id, version}: one entry with its YAML `content`
    and `payload` (the YAML as an object)."""

    doc = {
        "post": m.Op(
            "One catalog entry with its YAML content and payload", m.CatalogResource, m.ResourceBody, errors=(404,)
        )
    }

    open_methods = frozenset({"POST"})  # a read

    async def post(self) -> None:
        body = self.json_body()
        path = _catalog_path(body)
        version = optional(body, "version", (int, str), "a version")
        if version is not None and str(version) not in ("latest", "1"):
            raise ApiError(404, f"version: the catalog keeps the latest registration of {path!r} only (version 1)")
        self.answer(await self.db(self.entry, path))

    @staticmethod
    def entry(conn: Any, path: str) -> dict[str, Any]:
        row = repo.find_playbook(conn, path)
        if row is None:
            raise ApiError(404, f"no playbook registered at catalog path {path!r}", "path")
        return catalog_entry(row, row["content"])


class PlaybookContent(Api):
    """GET /api/catalog/playbook/content?playbook_id=<catalog id or path>: {"content": YAML}."""

    doc = {
        "get": m.Op(
            "A catalog entry's YAML by its catalog id (its path)", m.AnyObject, query=m.ContentQuery, errors=(404,)
        )
    }

    async def get(self) -> None:
        path = _catalog_path({"playbook_id": self.arg("playbook_id"), "path": self.arg("path")})
        entry = await self.db(CatalogResource.entry, path)
        self.answer({"catalog_id": entry["catalog_id"], "path": path, "content": entry["content"]})


class ValidateText(Api):
    """POST /api/catalog/playbooks/validate {content: YAML (raw or base64)}: {"valid", "errors"}.
    Behind the token, as /api/validate: compiling resolves sub-playbooks on the server."""

    doc = {"post": m.Op("Validate a playbook's YAML: {valid, errors}", m.ValidateText, m.ContentBody)}

    async def post(self) -> None:
        from noetl_celery import runner
        from noetl_celery.compiler import compile_playbook

        self.require_token()
        source = playbook_text(self.json_body())
        lookup = runner.catalog(self.noetl.database_url)

        def check() -> list[str]:
            try:
                compile_playbook("content", text=source, catalog=lookup)
            except PlaybookError as exc:
                return [str(p) for p in exc.problems]
            except (yaml.YAMLError, UnicodeError) as exc:
                return [f"content: not a YAML text: {str(exc).splitlines()[0][:200]}"]
            return []

        errors = await self.call(check)
        self.answer({"valid": not errors, "errors": errors})


class CredentialList(Api):
    """GET /api/credentials: none are kept here (see rest.CREDENTIALS_501); an empty list, so
    that the GUI's credentials page loads."""

    doc = {
        "get": m.Op("None are kept here: an empty list", m.Credentials),
        "post": m.Op("Not offered", m.Error, m.EmptyBody, body_required=False, status=501),
    }

    def get(self) -> None:
        self.answer({"items": [], "detail": CREDENTIALS_501})

    def post(self) -> None:
        raise ApiError(501, CREDENTIALS_501)


def gui_routes(api: dict[str, Any]) -> list[tuple[str, type, dict[str, Any]]]:
    return [
        (r"/api/dashboard/stats", DashboardStats, api),
        (r"/api/catalog/resource", CatalogResource, api),
        (r"/api/catalog/playbook/content", PlaybookContent, api),
        (r"/api/catalog/playbooks/validate", ValidateText, api),
        (r"/api/credentials", CredentialList, api),
    ]
