"""The schedules' routes of the REST API (noetl_celery/schedules/__init__.py; `celery -A noetl_celery beat`
fires them). Reads are open; add, remove, pause and resume need the Bearer token, as every write.

    GET    /api/schedules                 the schedules, with last and next fire times
    POST   /api/schedules                 add one: {name, playbook, cron | every, timezone,
                                          workload, missed, paused, replace}
    GET    /api/schedules/{name}          one, with its latest fire times and their executions
    DELETE /api/schedules/{name}          remove it (the record of its runs stays)
    POST   /api/schedules/{name}/pause    pause it
    POST   /api/schedules/{name}/resume   resume it from now on
"""

from __future__ import annotations

import asyncio
from typing import Any

import tornado.web

from noetl_celery.dashboard import models as m
from noetl_celery.dashboard.handlers import Base
from noetl_celery.dashboard.launch import Pages
from noetl_celery.dashboard.rest import Api, ApiError, optional, workload
from noetl_celery.store import views

MAX_RUNS = 1000


class _ScheduleApi(Api):
    async def schedule_call(self, fn: Any, *args: Any) -> Any:
        from noetl_celery.schedules import ScheduleError, ScheduleNotFound

        def run() -> Any:
            try:
                return fn(*args)
            except ScheduleError as exc:
                raise ApiError(400, str(exc), exc.field) from None
            except ScheduleNotFound as exc:
                raise ApiError(404, str(exc)) from None

        return await self.call(run)


class Schedules(_ScheduleApi):
    doc = {
        "get": m.Op("The schedules beat fires, with last and next fire times", m.Schedules),
        "post": m.Op(
            "Add a schedule (cron or every); replace: true overwrites one",
            m.AnyObject,
            m.ScheduleBody,
            status=201,
            errors=(404,),
        ),
    }

    async def get(self) -> None:
        from noetl_celery import schedules

        items = await self.schedule_call(schedules.list_all, self.noetl.database_url)
        self.answer({"schedules": items})

    async def post(self) -> None:
        from noetl_celery import schedules

        self.require_token()
        body = self.json_body()
        name = optional(body, "name", str, "the schedule's name")
        if name is None:
            raise ApiError(400, "name: expected the schedule's name", "name")
        playbook = optional(body, "playbook", str, "a catalog path or a playbook file on the server")
        if playbook is None:
            raise ApiError(400, "playbook: expected a catalog path (or a playbook file on the server)", "playbook")
        cron = optional(body, "cron", str, "a cron expression")
        every = optional(body, "every", int, "whole seconds")
        timezone = optional(body, "timezone", str, "an IANA time zone name", "UTC")
        missed = optional(body, "missed", str, "latest or skip", "latest")
        paused = optional(body, "paused", bool, "true or false", False)
        replace = optional(body, "replace", bool, "true or false", False)
        overrides = workload(body)
        url = self.noetl.database_url

        def add() -> dict[str, Any]:
            values = schedules.validate(
                name,
                playbook,
                cron=cron,
                every=every,
                timezone=timezone,
                workload=overrides,
                missed=missed,
                paused=paused,
            )
            return schedules.add(url, values, replace=replace)

        self.answer(await self.schedule_call(add), status=201)


class ScheduleOne(_ScheduleApi):
    doc = {
        "get": m.Op("A schedule and its latest fire times", m.AnyObject, query=m.ScheduleQuery),
        "delete": m.Op("Remove a schedule (the record of its runs stays)"),
    }

    async def get(self, name: str) -> None:
        from noetl_celery import schedules

        runs = self.int_arg("runs") or 20
        if not 1 <= runs <= MAX_RUNS:
            raise ApiError(400, f"runs: from 1 to {MAX_RUNS}, got {runs}", "runs")
        self.answer(await self.schedule_call(schedules.get, self.noetl.database_url, name, runs))

    async def delete(self, name: str) -> None:
        from noetl_celery import schedules

        self.require_token()
        await self.schedule_call(schedules.remove, self.noetl.database_url, name)
        self.answer({"name": name, "removed": True})


class SchedulePause(_ScheduleApi):
    doc = {"post": m.Op("Pause or resume a schedule, or run its playbook now", m.AnyObject, errors=(409,))}

    async def post(self, name: str, action: str) -> None:
        from noetl_celery import schedules

        self.require_token()
        self.json_body()
        if action == "run":
            self.require_runner()
            execution_id = await self.schedule_call(schedules.run_now, self.noetl, name)
            self.answer({"name": name, "execution_id": execution_id, "status": "running"})
            return
        item = await self.schedule_call(schedules.set_paused, self.noetl.database_url, name, action == "pause")
        self.answer(item)


class ScheduleAction(Pages):
    """POST /schedules/<name>/(pause|resume|run) from the schedules page: the dashboard's token
    (Basic or Bearer), its origin and XSRF checks (handlers.Control); run needs a server whose
    executions run."""

    async def post(self, name: str, action: str) -> None:  # type: ignore[override]
        from noetl_celery import schedules

        if action == "run":
            if not self.allowed():
                return
            await self.start(lambda: schedules.run_now(self.noetl, name))
            return
        if not self.admitted():
            return
        try:
            await asyncio.get_running_loop().run_in_executor(
                None, schedules.set_paused, self.noetl.database_url, name, action == "pause"
            )
        except schedules.ScheduleNotFound as exc:
            raise tornado.web.HTTPError(404, reason=str(exc)[:200]) from None
        self.redirect("/schedules")


class SchedulesPage(Base):
    """The dashboard's list of schedules (/schedules)."""

    async def get(self) -> None:
        from noetl_celery import schedules

        items = await asyncio.get_running_loop().run_in_executor(None, schedules.list_all, self.noetl.database_url)
        self.page("schedules.html", schedules=views.mask(items), can_pause=self.noetl.dashboard_token is not None)


def schedule_routes(api: dict[str, Any]) -> list[tuple[str, type, dict[str, Any]]]:
    page = {k: v for k, v in api.items() if k != "runs"}
    return [
        (r"/schedules", SchedulesPage, {**page, "runs": api.get("runs", False)}),
        (r"/schedules/([A-Za-z0-9][A-Za-z0-9_.:-]*)/(pause|resume|run)", ScheduleAction, api),
        (r"/api/schedules", Schedules, api),
        (r"/api/schedules/([A-Za-z0-9][A-Za-z0-9_.:-]*)/(pause|resume|run)", SchedulePause, api),
        (r"/api/schedules/([A-Za-z0-9][A-Za-z0-9_.:-]*)", ScheduleOne, api),
    ]
