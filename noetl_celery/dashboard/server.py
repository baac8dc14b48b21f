"""The execution dashboard and the REST API in one small Tornado application over the event store:
this module wires their routes (make_app) and serves them (serve). Read-only unless
NOETL_DASHBOARD_TOKEN is set (then the actions and the API's writes need it: handlers.py).

Tornado because it already ships with Flower (no new dependency), serves many slow polls from one
thread, and needs no build step; pages are Jinja2 templates rendered on the server (this module
makes their environment).

The modules stand one way, each importing only those below it: server; api.py (the REST API's
routes, NoETL's and the project's own, `noetl-celery server`); gui_api.py and schedules_api.py;
pages.py (the executions' pages), launch.py (launch and rerun from the browser), openapi.py (the
API's document, from the routes it is given) and metrics_page.py; rest.py (the JSON handlers'
base and helpers) and reads.py (the store reads the pages and the API share); handlers.py (every
handler's base); actions.py, probes.py, layout.py, models.py (.importlinter).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jinja2
import tornado.web

from noetl_celery.config import settings as noetl_settings
from noetl_celery.dashboard import api, launch, metrics_page, pages
from noetl_celery.store import views
from noetl_celery.store.db import ensure_schema

DEFAULT_HOST = "127.0.0.1"  # loopback: reachable from this machine only
DEFAULT_PORT = 8080
TEMPLATES = Path(__file__).with_name("templates")


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


def without_traceback(error: Any) -> Any:
    """An error dict without its traceback (shown apart, as lines)."""
    return {k: v for k, v in error.items() if k != "traceback"} if isinstance(error, dict) else error


def make_app(settings: noetl_settings.Settings | None = None, *, runs: bool = False) -> tornado.web.Application:
    """The dashboard's pages and the REST API (api.py); `runs`: executions started through the API
    run (a broker's workers, or this process's embedded worker)."""
    settings = settings or noetl_settings.load()
    ensure_schema(settings.database_url)
    common = {"settings": settings, "templates": _environment()}
    return tornado.web.Application(
        [
            *pages.routes(common, runs),
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
