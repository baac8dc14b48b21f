"""Launch and rerun from the browser: the registered playbooks, a launch form built from a
playbook's workload, and the rerun form of an execution's page.

Routes: `GET /playbooks` the catalog, `GET /playbooks/<path>` one playbook with its launch form,
`POST /playbooks/<path>` launches it (as `POST /api/execute`), `POST /executions/<id>/rerun`
reruns an execution (as `noetl-celery rerun`: `from_step`, `latest`, `set` lines of key=value).
The writes are the dashboard's actions: the token (Basic credentials a browser caches, or
Bearer), and from a browser only from the dashboard's own page (handlers.Control's origin and
XSRF checks). Each redirects to the new execution's page. Offered only where executions
started here run (`runs`: a broker's workers, or the embedded worker of `noetl-celery server`).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any
from urllib.parse import quote

import tornado.web

from noetl_celery.core.errors import ExecutionNotFound, NoetlError, PlaybookError
from noetl_celery.dashboard.handlers import Control
from noetl_celery.dsl import deep_merge
from noetl_celery.dsl.set_values import parse_assignments, scalar
from noetl_celery.store import views

FIELD_PREFIX = "w."  # form field names of the launch form: w.<index of the workload leaf>
SECRET_PLACEHOLDER = "secret: kept unless typed here"


@dataclass
class Field:
    """One workload value of the launch form: `path` into the workload, the text shown (its
    default: a string as it is, anything else as JSON), whether it is a secret (shown empty)."""

    name: str
    path: tuple[str, ...]
    label: str
    text: str
    is_text: bool
    secret: bool


def workload_fields(workload: dict[str, Any]) -> list[Field]:
    """The leaves of a workload (a non-empty mapping is walked into), in order."""
    masked = views.mask(workload) or {}
    return [
        Field(
            name=f"{FIELD_PREFIX}{index}",
            path=path,
            label=".".join(path),
            text="" if shown != value else _text(value),
            is_text=isinstance(value, str),
            secret=shown != value,
        )
        for index, (path, value, shown) in enumerate(_leaves(workload, masked, ()))
    ]


def _leaves(value: Any, shown: Any, path: tuple[str, ...]) -> Iterator[tuple[tuple[str, ...], Any, Any]]:
    if isinstance(value, dict) and value:
        for key, child in value.items():
            yield from _leaves(child, shown.get(key) if isinstance(shown, dict) else shown, (*path, str(key)))
    else:
        yield path, value, shown


def _text(value: Any) -> str:
    return value if isinstance(value, str) else json.dumps(value)


def changed_values(fields: list[Field], form: dict[str, str]) -> dict[str, Any]:
    """The workload overrides a submitted launch form asks for: the fields whose text differs
    from the default shown (a secret's only when something was typed), read back as the default
    was written (text, or JSON/YAML); raises tornado's 400 naming a field that does not parse."""
    overrides: dict[str, Any] = {}
    for field in fields:
        text = form.get(field.name)
        if text is None or text == field.text or (field.secret and not text):
            continue
        value: Any = text
        if not field.is_text:
            value = scalar(text)
            if isinstance(value, str) and text.strip()[:1] in ("[", "{"):
                raise tornado.web.HTTPError(400, reason=f"{field.label}: not JSON: {text[:60]!r}")
        target = overrides
        for part in field.path[:-1]:
            target = target.setdefault(part, {})
        target[field.path[-1]] = value
    return overrides


def assignments(text: str | None, what: str) -> dict[str, Any]:
    """`key=value` lines (as --set) of a form's text area; blank lines are skipped."""
    lines = [line for line in (text or "").splitlines() if line.strip()]
    try:
        return parse_assignments(lines)
    except ValueError as exc:
        raise tornado.web.HTTPError(400, reason=f"{what}: {exc}"[:200]) from None


class Pages(Control):
    """The catalog's pages and the browser's launch and rerun: GETs are pages; each POST is an
    action with handlers.Control's token, origin and XSRF checks, offered only where executions
    started here run (`runs`)."""

    def can_launch(self) -> bool:
        return self.runs and self.noetl.dashboard_token is not None

    def allowed(self) -> bool:
        """Whether this write may go on; False when answered already (401 asking for credentials)."""
        if not self.admitted():
            return False
        if not self.runs:
            raise tornado.web.HTTPError(
                503, reason="no worker runs executions started here: serve with `noetl-celery server`"
            )
        return True

    async def start(self, fn: Callable[[], int]) -> None:
        """Start an execution (`fn`, on a thread, returns its id) and show its page; a refusal is
        answered 4xx with the reason."""
        from noetl_celery.engine.recovery.rerun import RerunRefused

        try:
            new_id = await asyncio.get_running_loop().run_in_executor(None, fn)
        except ExecutionNotFound as exc:
            raise tornado.web.HTTPError(404, reason=str(exc)[:200]) from None
        except RerunRefused as exc:
            raise tornado.web.HTTPError(400 if exc.field else 409, reason=str(exc)[:200]) from None
        except PlaybookError as exc:
            found = not any("no playbook registered" in p.message for p in exc.problems)
            raise tornado.web.HTTPError(400 if found else 404, reason="; ".join(map(str, exc.problems))[:200]) from None
        except NoetlError as exc:  # the broker cannot be reached
            raise tornado.web.HTTPError(409, reason=str(exc).splitlines()[0][:200]) from None
        self.redirect(f"/executions/{new_id}")


class PlaybooksPage(Pages):
    async def get(self) -> None:
        from noetl_celery import runner

        entries = await asyncio.get_running_loop().run_in_executor(
            None, runner.catalog_entries, self.noetl.database_url
        )
        for entry in entries:
            entry["href"] = "/playbooks/" + quote(entry["path"], safe="/")
        self.page("playbooks.html", entries=entries, launch=self.can_launch())


class PlaybookPage(Pages):
    """GET: a registered playbook and its launch form; POST: launch it (as POST /api/execute)."""

    async def get(self, path: str) -> None:
        from noetl_celery import runner

        url = self.noetl.database_url
        try:
            plan = await asyncio.get_running_loop().run_in_executor(None, runner.compile_registered, path, {}, url)
        except PlaybookError as exc:
            if any("no playbook registered" in p.message for p in exc.problems):
                raise tornado.web.HTTPError(404, reason=f"no playbook registered at {path!r}"[:200]) from None
            raise tornado.web.HTTPError(409, reason=f"the registered playbook does not compile: {exc}"[:200]) from None
        self.page(
            "playbook.html",
            path=path,
            plan=plan,
            fields=workload_fields(plan.workload),
            action="/playbooks/" + quote(path, safe="/"),
            launch=self.can_launch(),
        )

    async def post(self, path: str) -> None:  # type: ignore[override]
        from noetl_celery import runner

        if not self.allowed():
            return
        settings = self.noetl
        form = {name: self.get_body_argument(name) for name in self.request.body_arguments}

        def launch() -> int:
            url = settings.database_url
            defaults = runner.compile_registered(path, {}, url)
            overrides = deep_merge(
                changed_values(workload_fields(defaults.workload), form),
                assignments(form.get("set"), "more parameters"),
            )
            return runner.submit(runner.compile_registered(path, overrides, url), settings)

        await self.start(launch)


class RerunAction(Pages):
    """POST /executions/<id>/rerun: `from_step` (empty: the whole playbook), `latest`, `set`."""

    async def post(self, execution_id: str) -> None:  # type: ignore[override]
        from noetl_celery import runner

        if not self.allowed():
            return
        from_step = self.get_body_argument("from_step", "").strip() or None
        latest = self.get_body_argument("latest", "") in ("1", "on", "true")
        overrides = assignments(self.get_body_argument("set", ""), "changed parameters")
        settings, old = self.noetl, int(execution_id)
        await self.start(lambda: runner.rerun(settings, old, overrides, from_step=from_step, latest=latest))


def routes(common: dict[str, Any], runs: bool) -> list[tuple[str, type, dict[str, Any]]]:
    pages = {**common, "runs": runs}
    return [
        (r"/playbooks", PlaybooksPage, pages),
        (r"/playbooks/(.+)", PlaybookPage, pages),
        (r"/executions/(\d+)/rerun", RerunAction, pages),
    ]
