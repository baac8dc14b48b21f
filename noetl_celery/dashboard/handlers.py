"""The base of every request handler of the server: `Base` (the store on a thread, the templates,
the dashboard token, the query's arguments) and `Control`, the base of every action a browser
sends (cancel, resume, launch, rerun, a schedule's pause): the token, and from a browser only from
the dashboard's own page.

The actions are POSTs authenticated by the token, sent as HTTP Basic auth (a browser caches it and
attaches it to every later request to this origin, whichever site triggered the request) or as
`Authorization: Bearer` (scripts). So a browser POST must also prove it came from the dashboard's
own page: a same-origin Sec-Fetch-Site/Origin/Referer and Tornado's XSRF token (the `_xsrf` cookie
echoed in the form); see Control.check_xsrf_cookie. Control itself answers
`POST /executions/<id>/(cancel|resume)` (actions.py).
"""

from __future__ import annotations

import asyncio
import base64
import hmac
from collections.abc import Callable
from typing import Any, TypeVar
from urllib.parse import urlsplit

import jinja2
import tornado.web
from markupsafe import Markup

from noetl_celery.config import settings as noetl_settings
from noetl_celery.core.errors import NoetlError
from noetl_celery.dashboard import actions, probes
from noetl_celery.store.db import transaction

LATEST = 2**63 - 1  # `before` of the event log's last page (the largest BIGINT)
LIVE_POLL_MS = 1000  # milliseconds between refreshes of a running execution's live panel
T = TypeVar("T")


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
