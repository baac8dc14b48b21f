"""The execution dashboard: a small Tornado application over the event store, read-only unless
NOETL_DASHBOARD_TOKEN is set (then cancel/resume, when those commands exist, need it).

The actions are POSTs authenticated by the token, sent as HTTP Basic auth (a browser caches it and
attaches it to every later request to this origin, whichever site triggered the request) or as
`Authorization: Bearer` (scripts). So a browser POST must also prove it came from the dashboard's
own page: a same-origin Sec-Fetch-Site/Origin/Referer and Tornado's XSRF token (the `_xsrf` cookie
echoed in the form); see Control.check_xsrf_cookie.

Tornado because it already ships with Flower (no new dependency), serves many slow polls from one
thread, and needs no build step; pages are Jinja2 templates rendered on the server, with a few
lines of JavaScript that refresh the live panel while the execution runs.

Routes: `/` executions (`?q=<id>` finds one, `?before=<id>` the next page, `playbook` matches a
part of the name), `/executions/<id>` one execution, `/executions/<id>/live` its live panel
(HTML fragment), `/api/executions/<id>` the same facts as JSON (with a page of its events, as
NoETL's API pages them). The REST API beside the pages: api.py (`noetl-celery server`).
"""

from __future__ import annotations

import asyncio
import base64
import hmac
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar
from urllib.parse import urlencode, urlsplit

import jinja2
import tornado.web
from markupsafe import Markup

from noetl_celery.config import settings as noetl_settings
from noetl_celery.core.errors import NoetlError
from noetl_celery.dashboard import actions, layout, probes
from noetl_celery.store import repo, views
from noetl_celery.store.db import ensure_schema, transaction
from noetl_celery.store.status import rerun_origin

DEFAULT_HOST = "127.0.0.1"  # loopback: reachable from this machine only
DEFAULT_PORT = 8080
LATEST = 2**63 - 1  # `before` of the event log's last page (the largest BIGINT)
LIVE_POLL_MS = 1000  # milliseconds between refreshes of a running execution's live panel
TEMPLATES = Path(__file__).with_name("templates")
T = TypeVar("T")


def _environment() -> jinja2.Environment:
    env = jinja2.Environment(
        loader=jinja2.FileSystemLoader(TEMPLATES), autoescape=True, undefined=jinja2.ChainableUndefined
    )
    env.filters["json"] = views.to_json
    env.filters["without_traceback"] = without_traceback
    env.filters["seconds"] = lambda s: "" if s is None else (f"{s:.1f} s" if s < 120 else f"{s / 60:.1f} min")
    env.filters["loop_count"] = views.loop_count  # done/total, or "N rows so far" for a cursor loop
    env.filters["stamp"] = lambda d: "" if d is None else d.strftime("%Y-%m-%d %H:%M:%S")
    return env


class Base(tornado.web.RequestHandler):
    """Shared by every page: the store, the templates, and authentication."""

    def initialize(self, settings: noetl_settings.Settings, templates: jinja2.Environment, runs: bool = False) -> None:
        self.noetl = settings
        self.templates = templates
        self.runs = runs  # executions started here run (a broker's workers, or an embedded worker)

    async def db(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """Run a store read on a thread (the queries are synchronous; the server stays responsive)."""

        def call() -> T:
            with transaction(self.noetl.database_url) as conn:
                return fn(conn, *args, **kwargs)

        return await asyncio.get_running_loop().run_in_executor(None, call)

    def prepare(self) -> None:
        """An id in the path beyond the store's 64-bit ids names nothing: 404, not a database error."""
        for value in self.path_args:
            if isinstance(value, str) and value.isdigit() and int(value) > LATEST:
                raise tornado.web.HTTPError(404, reason=f"no execution {value}")

    def send_error(self, status_code: int = 500, **kwargs: Any) -> None:
        """The store or the broker being unreachable answers 503 with what is down, not 500."""
        exc = kwargs.get("exc_info", (None, None, None))[1]
        if status_code == 500 and probes.outage(exc) is not None:
            status_code = 503
        super().send_error(status_code, **kwargs)

    def write_error(self, status_code: int, **kwargs: Any) -> None:
        exc = kwargs.get("exc_info", (None, None, None))[1]
        down = probes.outage(exc)
        if down is None:
            super().write_error(status_code, **kwargs)
            return
        self.set_header("Content-Type", "text/plain; charset=utf-8")
        self.set_header("Retry-After", "5")
        self.finish(f"503 Service Unavailable: {down}\n")

    def page(self, template: str, **values: Any) -> None:
        self.set_header("Content-Type", "text/html; charset=utf-8")
        self.set_header("Cache-Control", "no-store")
        can_control = self.can_control()
        can_launch = self.noetl.dashboard_token is not None and self.runs  # launch and rerun (launch.py)
        # the hidden _xsrf field of the action forms (and the _xsrf cookie, set on first use); a
        # read-only dashboard has no forms and sets no cookie
        xsrf = Markup(self.xsrf_form_html()) if can_control or can_launch else Markup("")
        self.finish(
            self.templates.get_template(template).render(
                flower_url=self.noetl.flower_url,
                can_control=can_control,
                can_launch=can_launch,
                xsrf_form_html=xsrf,
                poll_ms=LIVE_POLL_MS,
                **values,
            )
        )

    def can_control(self) -> bool:
        return self.noetl.dashboard_token is not None and bool(actions.available())

    def authorized(self) -> bool:
        token = self.noetl.dashboard_token
        if token is None:
            return False
        scheme, value = self.credentials()
        if scheme == "bearer":
            return hmac.compare_digest(value.encode(), token.encode())
        if scheme == "basic":
            try:
                _, _, password = base64.b64decode(value).decode().partition(":")
            except (ValueError, UnicodeDecodeError):
                return False
            return hmac.compare_digest(password.encode(), token.encode())
        return False

    def credentials(self) -> tuple[str, str]:
        """The Authorization header as (lower-case scheme, value)."""
        scheme, _, value = self.request.headers.get("Authorization", "").partition(" ")
        return scheme.lower(), value.strip()

    def arg(self, name: str) -> str | None:
        value = self.get_query_argument(name, None)
        return value.strip() if value and value.strip() else None

    def int_arg(self, name: str) -> int | None:
        value = self.arg(name)
        if value is None:
            return None
        try:
            number = int(value)
        except ValueError:
            raise tornado.web.HTTPError(400, reason=f"{name} must be a whole number, got {value!r}") from None
        if abs(number) > LATEST:
            raise tornado.web.HTTPError(400, reason=f"{name} must be at most {LATEST}, got {value!r}")
        return number


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


def _execution(conn: Any, execution_id: int, timeline: bool = True) -> dict[str, Any]:
    row = repo.get_execution(conn, execution_id)
    if row is None:
        raise tornado.web.HTTPError(404, reason=f"no execution {execution_id}")
    states = views.step_states(conn, execution_id)
    loops = views.loops(conn, execution_id)
    joins = views.joins(conn, execution_id)
    done, total = views.progress_of(conn, [execution_id])[execution_id]
    return {
        "execution": row,
        "workload": views.mask(row["workload"]),
        "states": states,
        "loops": loops,
        "joins": joins,
        "done": done,
        "total": total,
        "progress_pct": progress_percent(row["status"], done, total, states, loops),
        "graph": layout.graph(row["plan"], states, loops, joins),
        "timeline": layout.timeline(views.attempts(conn, execution_id)) if timeline else None,
        "children": views.list_executions(conn, parent=execution_id),
        "failure": views.failure(conn, row),
        "rerun": rerun_origin(conn, execution_id),
        "duration_s": views.duration_s(row["created_at"], row["finished_at"], views._now(row["created_at"])),
    }


def progress_percent(status: str, done: int, total: int, states: dict[str, Any], loops: list[dict[str, Any]]) -> float:
    """The width of an execution's progress bar: the units that succeeded, over the units known.
    A failed unit is finished but no progress, so a failed execution's bar is never full."""
    if status == "completed":
        return 100.0
    failed = sum(int(s.get("failed") or 0) for s in states.values()) + sum(int(lp.get("failed") or 0) for lp in loops)
    succeeded = max(0, done - failed)
    if not total:
        return 0.0
    return min(100.0 * succeeded / total, 99.0)  # only a completed execution's bar is full


def without_traceback(error: Any) -> Any:
    """An error dict without its traceback (shown apart, as lines)."""
    return {k: v for k, v in error.items() if k != "traceback"} if isinstance(error, dict) else error


def _full(conn: Any, execution_id: int, filters: dict[str, Any]) -> dict[str, Any]:
    data = _execution(conn, execution_id)
    path = data["execution"]["playbook_path"]
    data["registered"] = (repo.find_playbook(conn, path) or {}).get("registered_at") if path else None
    data["events"] = views.events_page(conn, execution_id, **filters)
    data["event_total"] = views.event_counts(conn, execution_id)
    return data


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
        data = await self.db(_full, int(execution_id), filters)
        kept = {k: v for k, v in filters.items() if v is not None and k not in ("after", "before")}
        events = data["events"]
        newer = urlencode({**kept, "after": events[-1]["id"]}) if events else None
        older = urlencode({**kept, "before": events[0]["id"]}) if events else None
        latest = urlencode({**kept, "latest": 1})
        self.page("execution.html", filters=kept, newer=newer, older=older, latest=latest, **data)


HISTORY_RUNS = 25  # executions in the run-history grid


def run_history(conn: Any, playbook: str, before: int | None) -> dict[str, Any]:
    """The last HISTORY_RUNS executions of `playbook` (its exact name), newest first, and the state
    of each step in each: the rows of the grid; its columns are the steps of the newest plan, then
    the steps only older runs had."""
    rows = [
        r
        for r in views.list_executions(conn, playbook=playbook, before=before, limit=4 * HISTORY_RUNS)
        if r["playbook_name"] == playbook
    ][:HISTORY_RUNS]
    steps: list[str] = []
    runs = []
    for r in rows:
        plan = (repo.get_execution(conn, r["execution_id"]) or {}).get("plan") or {}
        for step in plan.get("steps") or {}:
            if step not in steps:
                steps.append(step)
        runs.append({**r, "states": views.step_states(conn, r["execution_id"])})
    for run in runs:
        for step in run["states"]:
            if step not in steps:
                steps.append(step)
    return {"runs": runs, "steps": steps}


class HistoryPage(Base):
    """GET /history?playbook=NAME: runs x steps of one playbook (Airflow's grid), coloured by state."""

    async def get(self) -> None:
        playbook = self.arg("playbook")
        if playbook is None:
            raise tornado.web.HTTPError(400, reason="history: ?playbook=<its name> is needed")
        before = self.int_arg("before")
        data = await self.db(run_history, playbook, before)
        runs = data["runs"]
        older = (
            urlencode({"playbook": playbook, "before": runs[-1]["execution_id"]}) if len(runs) == HISTORY_RUNS else None
        )
        self.page("history.html", playbook=playbook, older=older, **data)


class LivePanel(Base):
    async def get(self, execution_id: str) -> None:
        data = await self.db(_execution, int(execution_id))
        self.page("live.html", **data)


class Control(Base):
    """POST /executions/<id>/(cancel|resume): only with the dashboard token, and from a browser only
    from the dashboard's own page."""

    def check_xsrf_cookie(self) -> None:
        """Called by Tornado before post() (xsrf_cookies=True): refuse a forged browser request.

        A browser attaches cached Basic credentials to a POST that any site's form or script sends
        here, so for Basic (or no) credentials the request must come from this origin (see
        same_origin) and carry the XSRF token of a page the dashboard served: the `_xsrf` form
        field or X-XSRFToken header, equal to the `_xsrf` cookie, which another site can neither
        read nor add to its form.

        `Authorization: Bearer` skips both checks. A browser never adds a Bearer header by itself
        (it caches and replays only Basic/Digest credentials and cookies), and a page on another
        site can set one only with fetch/XMLHttpRequest, which makes the request need a CORS
        preflight that this server never grants (it sends no Access-Control-Allow-* headers), so
        the POST is not sent. A Bearer request therefore comes from a client that holds the token
        (curl, scripts), which has no XSRF cookie to echo. The token itself is checked in post(),
        and a request has one Authorization header, so an invalid Bearer token is refused there
        and cannot fall back to cached Basic credentials.
        """
        if self.noetl.dashboard_token is None:
            return  # read-only: post() refuses every action
        if self.credentials()[0] == "bearer":
            return
        self.same_origin()
        try:
            super().check_xsrf_cookie()
        except tornado.web.HTTPError as exc:
            raise tornado.web.HTTPError(
                403, exc.log_message, reason="missing or wrong XSRF token: use the dashboard page's buttons"
            ) from None

    def same_origin(self) -> None:
        """Refuse a browser request sent from another origin (another site, or another port of this
        host, which shares its cookies). Browsers mark requests with Sec-Fetch-Site (on HTTPS and
        loopback); otherwise Origin, or Referer if no Origin, must name this host as the browser
        addressed it (Host, or X-Forwarded-Host behind a proxy). A request with none of these is
        not from a current browser and is left to the XSRF token."""
        site = self.request.headers.get("Sec-Fetch-Site")
        if site is not None:
            if site in ("same-origin", "none"):  # "none": opened by the user, not by a page
                return
            raise tornado.web.HTTPError(403, "Sec-Fetch-Site %r", site, reason="cross-site request refused")
        source = self.request.headers.get("Origin") or self.request.headers.get("Referer")
        if source is None:
            return
        hosts = {
            self.request.headers.get(name, "").split(",")[0].strip().lower() for name in ("Host", "X-Forwarded-Host")
        } - {""}
        if urlsplit(source).netloc.lower() not in hosts:
            raise tornado.web.HTTPError(403, "from %r", source, reason="cross-origin request refused")

    def admitted(self) -> bool:
        """Whether this action may go on: 403 on a read-only dashboard; False when answered already
        (401 asking for credentials)."""
        if self.noetl.dashboard_token is None:
            raise tornado.web.HTTPError(403, reason="read-only dashboard: set NOETL_DASHBOARD_TOKEN to allow actions")
        if not self.authorized():
            self.set_status(401)
            self.set_header("WWW-Authenticate", 'Basic realm="noetl-celery dashboard"')
            self.finish("authentication required")
            return False
        return True

    def post(self, execution_id: str, action: str) -> None:
        if not self.admitted():
            return
        fn = actions.available().get(action)
        if fn is None:
            raise tornado.web.HTTPError(404, reason=f"{action} is not available in this version")
        try:
            fn(self.noetl, int(execution_id))
        except NoetlError as exc:  # refused (e.g. nothing to resume) or the broker is unreachable
            raise tornado.web.HTTPError(409, reason=str(exc).splitlines()[0][:200]) from None
        self.redirect(f"/executions/{execution_id}")


def make_app(settings: noetl_settings.Settings | None = None, *, runs: bool = False) -> tornado.web.Application:
    """The dashboard's pages and the REST API (api.py); `runs`: executions started through the API
    run (a broker's workers, or this process's embedded worker)."""
    from noetl_celery.dashboard import api, launch, metrics_page

    settings = settings or noetl_settings.load()
    ensure_schema(settings.database_url)
    common = {"settings": settings, "templates": _environment()}
    return tornado.web.Application(
        [
            (r"/", ExecutionsPage, common),
            (r"/executions/(\d+)", ExecutionPage, {**common, "runs": runs}),
            (r"/executions/(\d+)/live", LivePanel, common),
            (r"/history", HistoryPage, common),
            (r"/executions/(\d+)/(cancel|resume)", Control, common),
            *api.routes(common, runs),
            *launch.routes(common, runs),
            *metrics_page.routes(common),
        ],
        # Control checks the token (check_xsrf_cookie). The cookie goes with no other site's POST
        # (SameSite=Lax) and no script can read it (other ports of this host share its cookies).
        xsrf_cookies=True,
        xsrf_cookie_kwargs={"httponly": True, "samesite": "Lax"},
        default_handler_class=api.NotFound,
        default_handler_args={**common, "runs": runs},
    )


def serve(
    host: str = DEFAULT_HOST,
    port: int = DEFAULT_PORT,
    settings: noetl_settings.Settings | None = None,
    on_ready: Callable[[], None] | None = None,
    *,
    runs: bool = False,
) -> None:
    """Run the dashboard and the REST API until interrupted; `on_ready` is called once it listens."""

    async def main() -> None:
        app = make_app(settings, runs=runs)
        app.listen(port, address=host)
        if on_ready is not None:
            on_ready()
        await asyncio.Event().wait()

    asyncio.run(main())
