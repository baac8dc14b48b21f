"""The REST API of `noetl-celery server`: NoETL's routes with NoETL's request and response shapes,
so that NoETL's own client (`noetl --server-url ...`) drives this engine unchanged.

Reads are open, as the dashboard's pages are (bind to loopback, or put a reverse proxy with its own
authentication in front). Every write needs `Authorization: Bearer <NOETL_DASHBOARD_TOKEN>`, the
token of the dashboard's actions; a server without that token refuses every write. Only the Bearer
form is accepted here: a browser never adds it by itself, so no other site can make a browser
send a write (no cookie and no cached Basic credentials count).

Beside NoETL's routes, the project's own for the rest of what the command line does: validate,
compile, submit a playbook body, list executions, events with filters, resume. Each route calls
the functions the command line calls (noetl_celery.runner, watch, compiler). A bad body gets 400
with `detail` naming the field; every answer is JSON with configured secrets masked.

The handlers stand on rest.py (Api, ApiError, the body readers); `routes` is the API's whole
route table, with gui_api.py's and schedules_api.py's, and `api_routes` its part that
openapi.py documents.
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any
from urllib.parse import urlencode

from noetl_celery.dashboard import models as m
from noetl_celery.dashboard import probes, reads
from noetl_celery.dashboard.gui_api import catalog_entry, gui_routes
from noetl_celery.dashboard.openapi import document
from noetl_celery.dashboard.rest import (
    CREDENTIALS_501,
    PLAYBOOK,
    Api,
    ApiError,
    iso_time,
    listed_execution,
    noetl_fields,
    optional,
    playbook_text,
    resource_kind,
    workload,
)
from noetl_celery.dashboard.schedules_api import schedule_routes
from noetl_celery.store import views

API_CANCEL_REASON = "cancelled through the REST API"
DEFAULT_CLEANUP_MINUTES = 5  # NoETL's default age of a "stuck" execution
MAX_CLEANUP_MINUTES = 100 * 366 * 24 * 60  # a century: more is no age an execution has
MAX_PAGE_SIZE = 1000  # events per page of GET /api/executions/{id}
# the last page number asked for: its offset, (page - 1) * page_size, stays inside a 64-bit integer
MAX_PAGE = 2**40


class Health(Api):
    """Liveness: the process answers (probes.py says why the store is not asked here)."""

    doc = {"get": m.Op("Liveness: the process answers", m.Health)}

    def get(self) -> None:
        self.answer(
            {
                "status": "ok",
                "message": "noetl-celery server is running",
                "timestamp": datetime.now(UTC).isoformat(),
                "runs_executions": self.runs,
            }
        )


class Ready(Api):
    """Readiness: 200 when the store is reachable at the schema head and the broker reachable,
    else 503; the body says which (probes.readiness)."""

    doc = {
        "get": m.Op(
            "Readiness: the store at the schema head and the broker reachable",
            m.Ready,
            extra_answers=((503, m.Ready, "unready: the part that is down"),),
        )
    }

    async def get(self) -> None:
        import asyncio

        body = await asyncio.get_running_loop().run_in_executor(None, probes.readiness, self.noetl)
        if body["status"] != "ready":
            self.set_header("Retry-After", "5")
        self.answer({**body, "runs_executions": self.runs}, 200 if body["status"] == "ready" else 503)


class CatalogRegister(Api):
    doc = {
        "post": m.Op(
            "Validate a playbook and register it under its metadata.path", m.Registered, m.RegisterBody, errors=(501,)
        )
    }

    async def post(self) -> None:
        from noetl_celery import runner

        self.require_token()
        body = self.json_body()
        kind = optional(body, "resource_type", str, "a string", PLAYBOOK)
        if kind.lower() == "credential":
            raise ApiError(501, CREDENTIALS_501, "resource_type")
        if kind.lower() != PLAYBOOK.lower():
            raise ApiError(400, f"resource_type: only {PLAYBOOK} is registered here, got {kind!r}", "resource_type")
        source = playbook_text(body)
        plan = await self.call(runner.register_text, source, self.noetl.database_url, "content")
        self.answer(
            {
                "status": "success",
                "message": f"{PLAYBOOK} registered at {plan.path}",
                "path": plan.path,
                "name": plan.name,
                "kind": PLAYBOOK,
                "resource_type": PLAYBOOK,
            }
        )


class CatalogList(Api):
    doc = {"post": m.Op("The registered playbooks", m.CatalogList, m.CatalogListBody, body_required=False)}

    open_methods = frozenset({"POST"})  # a read, as NoETL's client sends it

    async def post(self) -> None:
        from noetl_celery import runner

        body = self.json_body()
        kind = optional(body, "resource_type", str, "a string", PLAYBOOK)
        if kind.lower() != PLAYBOOK.lower():
            raise ApiError(
                400,
                f"resource_type: this catalog holds {PLAYBOOK} entries only, got {kind!r} "
                "(credentials come from NOETL_AUTH_* on the workers)",
                "resource_type",
            )
        rows = await self.call(runner.catalog_entries, self.noetl.database_url)
        entries = [catalog_entry(r) for r in rows]
        self.answer({"resource_type": PLAYBOOK, "entries": entries, "count": len(entries)})


class Execute(Api):
    doc = {
        "post": m.Op(
            "Start the playbook registered at path (or catalog_id)", m.Started, m.ExecuteBody, errors=(404, 409)
        )
    }

    async def post(self) -> None:
        from noetl_celery import runner

        self.require_token()
        body = self.json_body()
        path = body.get("path")
        if path is None and isinstance(body.get("catalog_id"), str):
            path = body["catalog_id"]  # NoETL's GUI starts an entry by its catalog_id (its path here)
        if not isinstance(path, str) or not path.strip():
            raise ApiError(400, "path: expected the catalog path (or catalog_id) of a registered playbook", "path")
        resource_kind(body)
        overrides = workload(body)
        version = optional(body, "version", (int, str), "a version number")
        if version is not None and str(version) not in ("latest", "1"):
            raise ApiError(
                400,
                f"version: the catalog keeps the latest registration of each path only (version 1), got {version!r}",
                "version",
            )
        self.require_runner()
        settings = self.noetl

        def start() -> tuple[int, Any]:
            plan = runner.compile_registered(path.strip(), overrides, settings.database_url)
            return runner.submit(plan, settings), plan

        execution_id, plan = await self.call(start)
        self.answer(
            {
                "execution_id": execution_id,
                "status": "running",
                "path": plan.path,
                "playbook": plan.name,
                "workload": plan.workload,
            }
        )


def _status(database_url: str, execution_id: int) -> dict[str, Any]:
    """`noetl-celery status --json`, and the fields NoETL's client reads from a status."""
    from noetl_celery import runner
    from noetl_celery.observe.watch import status_extras
    from noetl_celery.store.db import transaction

    result = runner.execution_status(database_url, execution_id)
    extras = status_extras(database_url, execution_id)
    with transaction(database_url) as conn:
        states = views.step_states(conn, execution_id)
    running = [step for step, s in states.items() if s.get("state") == "running"]
    return {**result, **extras, **noetl_fields(result["status"], result["created_at"], result["finished_at"])} | {
        "completed_steps": [step for step, s in states.items() if s.get("state") == "completed"],
        "current_step": running[0] if running else None,
    }


class Status(Api):
    doc = {"get": m.Op("`noetl-celery status --json`, with NoETL's completed/failed/current_step", m.StatusAnswer)}

    async def get(self, execution_id: str) -> None:
        self.answer(await self.call(_status, self.noetl.database_url, int(execution_id)))


DEFAULT_PAGE_SIZE = 10


class ExecutionJson(Api):
    """An execution's facts (the dashboard's JSON) and one page of its events, newest first, each
    with NoETL's `node_name` (its step): `?page=1&page_size=10`."""

    doc = {
        "get": m.Op(
            "An execution and one page of its events, newest first", m.ExecutionPage, query=m.ExecutionPageQuery
        )
    }

    async def get(self, execution_id: str) -> None:
        page = self.positive("page", 1)
        if page > MAX_PAGE:
            raise ApiError(400, f"page: at most {MAX_PAGE}, got {page}", "page")
        page_size = self.positive("page_size", DEFAULT_PAGE_SIZE)
        if page_size > MAX_PAGE_SIZE:
            raise ApiError(400, f"page_size: at most {MAX_PAGE_SIZE}, got {page_size}", "page_size")

        since_event_id = self.int_arg("since_event_id")
        event_type = self.arg("event_type")

        def read(conn: Any, eid: int) -> dict[str, Any]:
            data = reads.execution(conn, eid, False)
            data["events"] = views.events_numbered_page(
                conn, eid, page, page_size, after=since_event_id, event_type=event_type
            )
            data["event_total"] = views.events_numbered_total(conn, eid, after=since_event_id, event_type=event_type)
            return data

        data = await self.db(read, int(execution_id))
        row = data["execution"]
        total = data["event_total"]
        pages = (total + page_size - 1) // page_size
        self.answer(
            {
                "execution_id": row["execution_id"],
                "playbook": row["playbook_name"],
                "path": row["playbook_path"],
                "status": row["status"],
                "parent_execution_id": row["parent_execution_id"],
                "rerun": data["rerun"],
                "workload": data["workload"],
                "done": data["done"],
                "total": data["total"],
                "steps": data["states"],
                "loops": data["loops"],
                "failure": data["failure"],
                "children": [c["execution_id"] for c in data["children"]],
                **noetl_fields(row["status"], iso_time(row["created_at"]), iso_time(row["finished_at"])),
                "events": [{**event, "node_name": event["step"]} for event in data["events"]],
                "pagination": {
                    "page": page,
                    "page_size": page_size,
                    "total": total,
                    "pages": pages,
                    # NoETL's names of the same
                    "total_events": total,
                    "total_pages": pages,
                    "has_next": page < pages,
                    "has_prev": page > 1,
                },
            }
        )

    def positive(self, name: str, default: int) -> int:
        value = self.int_arg(name)
        if value is None:
            return default
        if value < 1:
            raise ApiError(400, f"{name}: expected 1 or more, got {value}", name)
        return value


class Cancel(Api):
    doc = {
        "post": m.Op(
            "Cancel a running execution and its running children",
            m.Cancelled,
            m.CancelBody,
            body_required=False,
            errors=(404, 409),
        )
    }

    async def post(self, execution_id: str) -> None:
        from noetl_celery import runner

        self.require_token()
        body = self.json_body()
        cascade = optional(body, "cascade", bool, "true or false", False)
        reason = optional(body, "reason", str, "a string") or API_CANCEL_REASON
        url, eid = self.noetl.database_url, int(execution_id)
        cancelled = await self.call(runner.cancel, url, eid, reason)
        if not cancelled:
            current = (await self.call(runner.execution_status, url, eid))["status"]
            raise ApiError(
                400,
                f"execution {eid} already {current}: nothing to cancel",
                message=f"execution {eid} already {current}: nothing to cancel",
                status=current,
            )
        children = len(cancelled) - 1
        self.answer(
            {
                "execution_id": eid,
                "status": "cancelled",
                # a child never outlives its parent here: its running children are cancelled
                # with it whatever `cascade` says
                "cascade": cascade,
                "cancelled_executions": [str(i) for i in cancelled],
                "message": f"execution {eid} cancelled" + (f" with {children} child executions" if children else ""),
                "reason": reason,
            }
        )


class Rerun(Api):
    """A new execution made from this one (runner.rerun, as `noetl-celery rerun`): NoETL's body
    (`workload`, `resource_kind`), plus `from_step` (start there, the steps before it keep their
    results) and `latest` (the playbook registered at its path now, not the stored plan)."""

    doc = {
        "post": m.Op(
            "A new execution made from this one, whole or from a step",
            m.Rerun,
            m.RerunBody,
            body_required=False,
            errors=(404, 409),
        )
    }

    async def post(self, execution_id: str) -> None:
        self.require_token()
        body = self.json_body()
        resource_kind(body)
        overrides = workload(body)
        from_step = optional(body, "from_step", str, "a step name")
        latest = optional(body, "latest", bool, "true or false", False)
        self.require_runner()
        settings, old = self.noetl, int(execution_id)
        new_id = await self.call(rerun_or_refusal, settings, old, overrides, from_step, latest)
        self.answer(
            {
                "execution_id": new_id,
                "rerun_of": old,
                "from_step": from_step,
                "latest": latest,
                "status": "running",
            }
        )


def rerun_or_refusal(settings: Any, execution_id: int, overrides: dict[str, Any], from_step: Any, latest: bool) -> int:
    """runner.rerun, its refusal as a 400 naming the field (or 409 when none is wrong)."""
    from noetl_celery import runner
    from noetl_celery.engine.recovery.rerun import RerunRefused

    try:
        return runner.rerun(settings, execution_id, overrides, from_step=from_step, latest=latest)
    except RerunRefused as exc:
        raise ApiError(400 if exc.field else 409, str(exc), exc.field) from None


class Cleanup(Api):
    doc = {
        "post": m.Op(
            "Cancel top-level executions running for more than older_than_minutes",
            m.Cleanup,
            m.CleanupBody,
            body_required=False,
            errors=(409,),
        )
    }

    async def post(self) -> None:
        from noetl_celery import runner

        self.require_token()
        body = self.json_body()
        minutes = optional(body, "older_than_minutes", (int, float), "a number of minutes", DEFAULT_CLEANUP_MINUTES)
        if not 0 <= minutes <= MAX_CLEANUP_MINUTES:
            raise ApiError(
                400, f"older_than_minutes: from 0 to {MAX_CLEANUP_MINUTES}, got {minutes}", "older_than_minutes"
            )
        dry_run = optional(body, "dry_run", bool, "true or false", False)
        ids = await self.call(runner.cleanup, self.noetl.database_url, minutes, dry_run)
        verb = "would cancel" if dry_run else "cancelled"
        self.answer(
            {
                "dry_run": dry_run,
                "older_than_minutes": minutes,
                "cancelled_count": len(ids),
                "execution_ids": ids,
                "message": f"{verb} {len(ids)} execution(s) running for more than {minutes:g} min",
            }
        )


# --- the project's own routes: what the command line does -----------------------------------

STATUSES = ("running", "completed", "failed", "cancelled")
DEFAULT_LIST = 20  # executions of GET /api/executions, as `noetl-celery executions`
MAX_LIST = 1000
DEFAULT_EVENTS = 1000  # rows of GET /api/executions/{id}/events
MAX_EVENTS = 10000


class Executions(Api):
    """GET /api/executions: NoETL's shape, a JSON array of executions, newest first, filtered by
    ?status=&playbook=(part of the name)&path=(catalog path)&parent=(id)&since=&until=(ISO 8601
    start times, since <= start < until)&limit=; the next page is ?cursor=<X-Next-Cursor> (also
    in the `Link: <...>; rel="next"` header), absent on the last page."""

    doc = {
        "get": m.Op(
            "Executions, newest first, filtered; the next page is ?cursor=<X-Next-Cursor>",
            list[m.ListedExecution],
            query=m.ExecutionsQuery,
        )
    }

    async def get(self) -> None:
        status = self.arg("status")
        if status is not None and status not in STATUSES:
            raise ApiError(400, f"status: one of {', '.join(STATUSES)}, got {status!r}", "status")
        limit = self.bounded("limit", DEFAULT_LIST, MAX_LIST)
        filters = {
            "status": status,
            "playbook": self.arg("playbook"),
            "path": self.arg("path"),
            "parent": self.id_arg("parent"),
            "since": self.time_arg("since"),
            "until": self.time_arg("until"),
            "before": self.id_arg("cursor") or self.id_arg("before"),
        }
        rows = await self.db(views.list_executions, limit=limit + 1, **filters)  # one more: is there a next page?
        if len(rows) > limit:
            cursor = str(rows[limit - 1]["execution_id"])
            query = {k: v for k, v in self.request.query_arguments.items() if k not in ("cursor", "before")}
            link = self.request.path + "?" + urlencode({**query, "cursor": cursor}, doseq=True)
            self.set_header("X-Next-Cursor", cursor)
            self.set_header("Link", f'<{link}>; rel="next"')
        self.answer([listed_execution(r) for r in rows[:limit]])

    def bounded(self, name: str, default: int, most: int) -> int:
        value = self.int_arg(name)
        if value is None:
            return default
        if not 1 <= value <= most:
            raise ApiError(400, f"{name}: from 1 to {most}, got {value}", name)
        return value

    def id_arg(self, name: str) -> int | None:
        value = self.arg(name)
        if value is None:
            return None
        if not value.isdigit() or int(value) > 2**63 - 1:
            raise ApiError(400, f"{name}: expected an execution id (digits), got {value[:40]!r}", name)
        return int(value)

    def time_arg(self, name: str) -> datetime | None:
        value = self.arg(name)
        if value is None:
            return None
        try:
            moment = datetime.fromisoformat(value.replace("Z", "+00:00").replace(" ", "+"))
        except ValueError:
            raise ApiError(
                400, f"{name}: expected an ISO 8601 time (2026-01-31T12:00:00Z), got {value[:40]!r}", name
            ) from None
        return moment if moment.tzinfo is not None else moment.replace(tzinfo=UTC)


class Events(Executions):
    """`noetl-celery events ID --json`: the rows in id order, ?after=<event id>&type=&step=&limit=
    (repeat type and step for several); the next page starts after the last id."""

    doc = {"get": m.Op("`noetl-celery events --json`: rows in id order after `after`", m.Events, query=m.EventsQuery)}

    async def get(self, execution_id: str) -> None:  # type: ignore[override]
        from noetl_celery.observe.watch import stream_events

        limit = self.bounded("limit", DEFAULT_EVENTS, MAX_EVENTS)
        after = self.int_arg("after")
        types = tuple(self.get_query_arguments("type"))
        steps = tuple(self.get_query_arguments("step"))
        url, eid = self.noetl.database_url, int(execution_id)
        rows = await self.call(
            lambda: list(stream_events(url, eid, types=types, steps=steps, after_id=after, limit=limit))
        )
        self.answer({"execution_id": eid, "events": rows, "next_after": rows[-1]["id"] if rows else after})


MAX_ATTEMPTS_LISTED = 1000


def attempt_summary(row: dict[str, Any]) -> dict[str, Any]:
    meta = row.get("meta") or {}
    return {
        "n": row["n"],
        "event_id": row["id"],
        "step": row["step"],
        "iteration": row["iteration"],
        "retry": row["attempt"],  # the attempt's number among the tries of its step (or iteration)
        "status": row["status"],
        "event_type": row["event_type"],
        "worker": row["worker"],
        "started_at": iso_time(row["started_at"]),
        "ended_at": iso_time(row["created_at"]),
        "duration_ms": row["duration_ms"],
        "has_output": any(meta.get(k) for k in views.ATTEMPT_OUTPUT),
    }


class Attempts(Executions):
    """GET /api/executions/{id}/attempts?first=1&limit=100: the attempts in the order they ended,
    numbered from 1 (`n`, the number of .../attempts/{n}/log)."""

    doc = {"get": m.Op("The attempts in the order they ended, numbered from 1", m.Attempts, query=m.AttemptsQuery)}

    async def get(self, execution_id: str) -> None:  # type: ignore[override]
        first = self.bounded("first", 1, 2**31)
        limit = self.bounded("limit", 100, MAX_ATTEMPTS_LISTED)
        eid = int(execution_id)
        rows = await self.db(self.read, eid, first, limit)
        self.answer({"execution_id": eid, "attempts": [attempt_summary(r) for r in rows]})

    @staticmethod
    def read(conn: Any, eid: int, first: int, count: int) -> list[dict[str, Any]]:
        from noetl_celery.store import repo

        if repo.get_execution(conn, eid) is None:
            raise ApiError(404, f"no execution {eid}")
        return views.attempt_rows(conn, eid, first, count)


class AttemptLog(Api):
    """GET /api/executions/{id}/attempts/{n}/log: what attempt `n` wrote, as the store keeps it
    (stdout and stderr of a python task, and its `logging` records), with the attempt's step,
    iteration, retry, status, worker and error."""

    doc = {"get": m.Op("What attempt n wrote: stdout, stderr, logging lines, its error", m.AttemptLog)}

    async def get(self, execution_id: str, n: str) -> None:
        eid, number = int(execution_id), int(n)
        if number < 1:
            raise ApiError(404, f"no attempt {number}: attempts are numbered from 1")
        rows = await self.db(Attempts.read, eid, number, 1)
        if not rows:
            raise ApiError(404, f"execution {eid} has no attempt {number}")
        row = rows[0]
        meta = row.get("meta") or {}
        log = meta.get("log")
        self.answer(
            {
                "execution_id": eid,
                **attempt_summary(row),
                "stdout": meta.get("stdout") or "",
                "stderr": meta.get("stderr") or "",
                "log": log if isinstance(log, list) else ([] if not log else str(log).splitlines()),
                "error": row.get("error"),
            }
        )


class Resume(Api):
    """`noetl-celery resume ID`: the same execution continues from what did not complete."""

    doc = {
        "post": m.Op(
            "`resume`: the same execution continues from what did not complete",
            m.Resumed,
            m.EmptyBody,
            body_required=False,
            errors=(409,),
        )
    }

    async def post(self, execution_id: str) -> None:
        from noetl_celery import runner

        self.require_token()
        self.json_body()
        self.require_runner()
        epoch = await self.call(runner.resume, self.noetl, int(execution_id))
        self.answer({"execution_id": int(execution_id), "status": "running", "epoch": epoch})


class Compile(Api):
    """`noetl-celery validate` / `compile --json` of a playbook sent as `content` (base64), with
    `workload` overrides. Behind the token: compiling resolves sub-playbooks on the server."""

    doc = {
        "post": m.Op("`validate` / `compile --json` of a playbook body", m.AnyObject, m.ContentBody, errors=(404, 409))
    }

    async def post(self, action: str) -> None:
        from noetl_celery import runner
        from noetl_celery.compiler import compile_playbook, describe

        self.require_token()
        body = self.json_body()
        source, overrides = playbook_text(body), workload(body)
        settings = self.noetl
        lookup = runner.catalog(settings.database_url)
        plan = await self.call(lambda: compile_playbook("content", text=source, overrides=overrides, catalog=lookup))
        if action == "validate":
            self.answer({"valid": True, "name": plan.name, "path": plan.path, "steps": list(plan.steps)})
            return
        described = describe(plan, task_queue=settings.task_queue, event_queue=settings.event_queue)
        self.answer({**described, "plan": plan.model_dump(mode="json")})


class Submit(Api):
    """`noetl-celery submit` of a playbook sent as `content` (base64), without registering it."""

    doc = {"post": m.Op("`submit` of a playbook body, not registered", m.Started, m.ContentBody, errors=(404, 409))}

    async def post(self) -> None:
        from noetl_celery import runner
        from noetl_celery.compiler import compile_playbook

        self.require_token()
        body = self.json_body()
        source, overrides = playbook_text(body), workload(body)
        self.require_runner()
        settings = self.noetl
        lookup = runner.catalog(settings.database_url)

        def start() -> tuple[int, Any]:
            plan = compile_playbook("content", text=source, overrides=overrides, catalog=lookup)
            return runner.submit(plan, settings), plan

        execution_id, plan = await self.call(start)
        self.answer({"execution_id": execution_id, "status": "running", "playbook": plan.name})


class Credentials(Api):
    doc = {
        "get": m.Op("Not offered: credentials come from NOETL_AUTH_* on the workers", m.Error, status=501),
        "post": m.Op("Not offered", m.Error, status=501),
    }

    def get(self, name: str) -> None:
        raise ApiError(501, CREDENTIALS_501)

    def post(self, name: str) -> None:
        raise ApiError(501, CREDENTIALS_501)


class NotFound(Api):
    """Every path no route matches: a JSON 404 (Application's default_handler_class)."""

    def prepare(self) -> None:
        raise ApiError(404, f"no route {self.request.path!r}: see /api/openapi.json")


class OpenApi(Api):
    doc = {"get": m.Op("This document")}

    def get(self) -> None:
        self.answer(document(api_routes()))


def routes(common: dict[str, Any], runs: bool) -> list[tuple[str, type, dict[str, Any]]]:
    api = {**common, "runs": runs}
    return [
        *schedule_routes(api),
        (r"/api/executions/(\d+)", ExecutionJson, api),
        (r"/health", Health, api),
        (r"/api/health", Health, api),
        (r"/ready", Ready, api),
        (r"/api/ready", Ready, api),
        (r"/api/openapi\.json", OpenApi, api),
        (r"/api/catalog/register", CatalogRegister, api),
        (r"/api/catalog/list", CatalogList, api),
        (r"/api/execute", Execute, api),
        (r"/api/(validate|compile)", Compile, api),
        (r"/api/submit", Submit, api),
        (r"/api/executions", Executions, api),
        (r"/api/executions/(\d+)/events", Events, api),
        (r"/api/executions/(\d+)/attempts", Attempts, api),
        (r"/api/executions/(\d+)/attempts/(\d+)/log", AttemptLog, api),
        (r"/api/executions/(\d+)/resume", Resume, api),
        (r"/api/executions/cleanup", Cleanup, api),
        (r"/api/executions/(\d+)/status", Status, api),
        (r"/api/executions/(\d+)/cancel", Cancel, api),
        (r"/api/executions/(\d+)/stop", Cancel, api),  # NoETL's GUI's stop
        (r"/api/executions/(\d+)/rerun", Rerun, api),
        *gui_routes(api),
        (r"/api/credentials/(.+)", Credentials, api),
    ]


def api_routes() -> list[tuple[str, type]]:
    """The API's path patterns and handlers (the dashboard's pages left out): openapi.py's input."""
    return [(pattern, handler) for pattern, handler, _ in routes({}, True) if issubclass(handler, Api)]
