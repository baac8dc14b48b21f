"""The dashboard's pages of executions: `/` executions (`?q=<id>` finds one, `?before=<id>` the next
page, `playbook` matches a part of the name), `/executions/<id>` one execution,
`/executions/<id>/live` its live panel (HTML fragment), `/history?playbook=NAME` a playbook's
run history, and the execution page's cancel and resume buttons (handlers.Control). Pages are
Jinja2 templates rendered on the server (server.py makes their environment), with a few lines
of JavaScript that refresh the live panel while the execution runs.
"""

from __future__ import annotations

from typing import Any
from urllib.parse import urlencode

import tornado.web

from noetl_celery.dashboard import reads
from noetl_celery.dashboard.handlers import LATEST, Base, Control
from noetl_celery.store import views


class ExecutionsPage(Base):
    async def get(self) -> None:
        status, playbook, parent = self.arg("status"), self.arg("playbook"), self.int_arg("parent")
        search, before = self.arg("q"), self.int_arg("before")
        execution_id = None
        if search is not None:
            if not search.isdigit():
                raise tornado.web.HTTPError(400, reason=f"search by execution id: a whole number, got {search!r}")
            execution_id = int(search)
        size = views.EXECUTION_PAGE_SIZE
        rows = await self.db(
            views.list_executions,
            status=status,
            playbook=playbook,
            parent=parent,
            execution_id=execution_id,
            before=before,
            limit=size + 1,  # one more tells whether an older page exists
        )
        kept = {k: v for k, v in (("status", status), ("playbook", playbook), ("parent", parent)) if v is not None}
        older = urlencode({**kept, "before": rows[size - 1]["execution_id"]}) if len(rows) > size else None
        self.page(
            "executions.html",
            rows=rows[:size],
            status=status or "",
            playbook=playbook or "",
            search=search or "",
            older=older,
            newest=f"/?{urlencode(kept)}" if before is not None else None,
            statuses=("running", "completed", "failed", "cancelled"),
        )


class ExecutionPage(Base):
    async def get(self, execution_id: str) -> None:
        filters = {
            "after": self.int_arg("after"),
            "before": self.int_arg("before"),
            "event_type": self.arg("event_type"),
            "step": self.arg("step"),
            "status": self.arg("status"),
            "iteration": self.int_arg("iteration"),
        }
        if self.arg("latest") is not None and filters["after"] is None and filters["before"] is None:
            filters["before"] = LATEST  # the last page of the log
        data = await self.db(reads.with_events, int(execution_id), filters)
        kept = {k: v for k, v in filters.items() if v is not None and k not in ("after", "before")}
        events = data["events"]
        newer = urlencode({**kept, "after": events[-1]["id"]}) if events else None
        older = urlencode({**kept, "before": events[0]["id"]}) if events else None
        latest = urlencode({**kept, "latest": 1})
        self.page("execution.html", filters=kept, newer=newer, older=older, latest=latest, **data)


class HistoryPage(Base):
    """GET /history?playbook=NAME: runs x steps of one playbook (Airflow's grid), coloured by state."""

    async def get(self) -> None:
        playbook = self.arg("playbook")
        if playbook is None:
            raise tornado.web.HTTPError(400, reason="history: ?playbook=<its name> is needed")
        before = self.int_arg("before")
        data = await self.db(reads.run_history, playbook, before)
        runs = data["runs"]
        full = len(runs) == reads.HISTORY_RUNS
        older = urlencode({"playbook": playbook, "before": runs[-1]["execution_id"]}) if full else None
        self.page("history.html", playbook=playbook, older=older, **data)


class LivePanel(Base):
    async def get(self, execution_id: str) -> None:
        data = await self.db(reads.execution, int(execution_id))
        self.page("live.html", **data)


def routes(common: dict[str, Any], runs: bool) -> list[tuple[str, type, dict[str, Any]]]:
    return [
        (r"/", ExecutionsPage, common),
        (r"/executions/(\d+)", ExecutionPage, {**common, "runs": runs}),
        (r"/executions/(\d+)/live", LivePanel, common),
        (r"/history", HistoryPage, common),
        (r"/executions/(\d+)/(cancel|resume)", Control, common),
    ]
