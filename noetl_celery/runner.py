"""Submitting executions, following them, and the embedded run (a worker inside this process).

The CLI is a thin layer over these functions; a Python user calls the same ones.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from sqlalchemy import Connection

from noetl_celery.compiler import compile_playbook, resolve
from noetl_celery.config import settings as noetl_settings
from noetl_celery.core import vocabulary as ev
from noetl_celery.core.errors import BrokerUnavailable, ExecutionNotFound, Interrupted, PlaybookError, Problem
from noetl_celery.core.vocabulary import ErrorKind
from noetl_celery.dsl.plan import Plan
from noetl_celery.engine.context import ExecutionState, new_state
from noetl_celery.engine.decision.orchestrator import start_new
from noetl_celery.engine.ids import new_execution_id
from noetl_celery.engine.recovery.lifecycle import end_tree
from noetl_celery.store import executions
from noetl_celery.store import schedules as notifications
from noetl_celery.store.catalog import find_playbook, list_playbooks, register_playbook
from noetl_celery.store.db import decision_transaction, ensure_schema, transaction
from noetl_celery.store.executions import (
    child_executions,
    delete_unpublished_execution,
    execution_head,
    list_executions,
    running_since,
)
from noetl_celery.store.kernel import utcnow
from noetl_celery.store.status import execution_events as execution_events
from noetl_celery.store.status import execution_status as execution_status
from noetl_celery.store.status import not_found

log = logging.getLogger(__name__)

EMBEDDED_CONCURRENCY = 4  # worker threads of `noetl-celery run`
POLL_INTERVAL = 0.05  # seconds between status reads while waiting


def create_execution(plan: Plan, database_url: str, *, parent_execution_id: int | None = None) -> int:
    """A new running execution of `plan`, not started yet (its start event decides that)."""
    ensure_schema(database_url)
    execution_id = new_execution_id()
    with transaction(database_url) as conn:
        _insert_execution(conn, plan, execution_id, parent_execution_id)
    return execution_id


def _insert_execution(
    conn: Connection,
    plan: Plan,
    execution_id: int,
    parent_execution_id: int | None = None,
    *,
    pending: int = 0,
    state_version: int = 0,
    stored: dict[str, Any] | None = None,
) -> None:
    """`stored`: the plan in its JSON form, when the caller has it already."""
    executions.create_execution(
        conn,
        execution_id=execution_id,
        plan=stored if stored is not None else plan.model_dump(mode="json"),
        workload=plan.workload,
        parent_execution_id=parent_execution_id,
        timeout=plan.timeout,
        pending=pending,
        state_version=state_version,
    )
    if parent_execution_id is None and "completed" in (plan.webhook_events or ()):
        notifications.expect_completion(conn, execution_id, utcnow())  # webhooks.py: the scan finds it


Start = Callable[[Connection, ExecutionState, Callable[[int, int], None]], list[Any]]
Claim = Callable[[Connection, int], None]


def create_started(
    plan: Plan, database_url: str, start: Start = start_new, claim: Claim | None = None
) -> tuple[int, list[Any]]:
    """A new execution of `plan` and the decision of its start (`start`: orchestrator.start_new,
    or a rerun's start), in one transaction; returns its id and the dispatches to publish.
    `claim(conn, execution_id)` runs first in that transaction (a schedule's claim of its fire
    time): if it raises, nothing is recorded."""
    ensure_schema(database_url)
    execution_id = new_execution_id()
    stored = plan.model_dump(mode="json")
    with decision_transaction(database_url) as conn:  # the execution row and its start: both or neither
        if claim is not None:
            claim(conn, execution_id)
        dispatches = start(
            conn,
            new_state(plan, execution_id, stored),
            lambda pending, version: _insert_execution(
                conn, plan, execution_id, pending=pending, state_version=version, stored=stored
            ),
        )
    return execution_id, dispatches


def submit(plan: Plan, settings: noetl_settings.Settings | None = None, *, claim: Claim | None = None) -> int:
    """Create the execution and decide its start in the same transaction, as on_event would
    (the start rows and the first step's messages are recorded with the execution), then publish
    those messages. The first task so starts one broker hop and one commit sooner than through
    the on_event queue.

    A start that cannot be decided leaves nothing behind. A broker that cannot be reached
    raises BrokerUnavailable, and the execution is removed again with every row its start
    wrote: nothing is left of what the user was told did not start.

    `claim(conn, execution_id)` runs first in the start's transaction (a schedule's claim of its
    fire time, noetl_celery/schedules/__init__.py): if it raises, nothing is recorded. A claimed start is
    kept when the broker cannot be reached (its claim is spent): the sweeper publishes its first
    messages from the stored dispatch list when their deadline passes."""
    from noetl_celery.app import app

    settings = settings or app.conf.noetl_settings
    execution_id, dispatches = create_started(plan, settings.database_url, claim=claim)
    _publish_start(settings, execution_id, dispatches, keep=claim is not None)
    return execution_id


def _publish_start(
    settings: noetl_settings.Settings, execution_id: int, dispatches: list[Any], *, keep: bool = False
) -> None:
    """Publish a new execution's first messages; when the broker cannot be reached, remove it
    again with every row its start wrote and raise BrokerUnavailable (`keep`: leave a claimed
    start to the sweeper, which publishes its stored first messages once their deadline passes)."""
    from noetl_celery import app  # noqa: F401  (binds the Celery app to the transport)
    from noetl_celery.engine.transport.publish import SUBMIT_RETRY_POLICY, publish

    try:
        publish(dispatches, retry_policy=SUBMIT_RETRY_POLICY)
    except Exception as exc:
        if keep:
            log.warning("execution %s started, its first messages wait for the broker: %s", execution_id, exc)
            return
        with transaction(settings.database_url) as conn:
            delete_unpublished_execution(conn, execution_id)
        raise BrokerUnavailable(
            f"cannot reach the broker at {_safe_url(settings.broker_url or '')}: {_first_line(exc)}"
        ) from exc


def cancel(database_url: str, execution_id: int, reason: str | None = None) -> list[int]:
    """Cancel a running execution and its running children; returns the ids cancelled (empty when
    it had already ended). Attempts in flight finish and their outcomes are recorded, but nothing
    is dispatched after them; delayed messages are dropped when they come due."""
    ensure_schema(database_url)
    error = {"kind": ErrorKind.CANCELLED, "message": reason or "cancelled"}
    with transaction(database_url) as conn:
        if execution_head(conn, execution_id) is None:
            raise not_found(database_url, execution_id)
        ended = end_tree(conn, execution_id, "cancelled", ev.EXECUTION_CANCELLED, error)
    if execution_id in ended:
        _notify_now(database_url, execution_id)
    return ended


def _notify_now(database_url: str, execution_id: int) -> None:
    """Enqueue the failure webhook of an execution this process ended (the sweep's scan would
    find it too, a sweep later)."""
    from noetl_celery.app import app, current_settings
    from noetl_celery.engine.transport.sweeping import enqueue_notifications
    from noetl_celery.observe import webhooks

    if not (app.conf.noetl_embedded or app.conf.noetl_settings.broker_url):
        return  # no worker would take it: the sweep of the deployment's workers sends it
    try:
        if webhooks.wanted(current_settings(), execution_id, database_url):
            enqueue_notifications([execution_id])
    except Exception as exc:  # the cancel is recorded; the sweep finds the notification
        log.warning("webhook of execution %s not enqueued: %s", execution_id, exc)


def resume(settings: noetl_settings.Settings, execution_id: int) -> int:
    """Resume a failed or cancelled execution (same execution, next epoch: engine/recovery/resume.py);
    returns the new epoch. Raises ResumeRefused with the reason when it cannot resume."""
    from noetl_celery import app  # noqa: F401  (binds the Celery app to the transport)
    from noetl_celery.engine.recovery.resume import resume as resume_execution
    from noetl_celery.engine.transport.publish import publish

    ensure_schema(settings.database_url)
    epoch, dispatches = resume_execution(settings.database_url, execution_id)
    try:
        publish(dispatches)
    except Exception as exc:  # recorded: the sweeper publishes them when their deadline passes
        raise BrokerUnavailable(
            f"execution {execution_id} resumed (epoch {epoch}), but the broker could not be "
            f"reached ({_first_line(exc)}); its attempts are sent when it is back"
        ) from exc
    return epoch


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}".rstrip(": ")


def wait(
    database_url: str, execution_id: int, timeout: float | None = None, on_poll: Callable[[int], None] | None = None
) -> dict[str, Any]:
    """Poll until the execution is no longer running (or `timeout` seconds pass); `on_poll`
    (e.g. live progress) is called with the execution id between reads."""
    deadline = None if timeout is None else time.monotonic() + timeout
    while True:
        if on_poll is not None:
            on_poll(execution_id)
        with transaction(database_url) as conn:
            head = execution_head(conn, execution_id)
        if head is None:
            raise ExecutionNotFound(f"no execution {execution_id}")
        if head["status"] != "running":
            break  # attempts still in flight after a failure are recorded, not waited for
        if deadline is not None and time.monotonic() > deadline:
            break
        time.sleep(POLL_INTERVAL)
    return execution_status(database_url, execution_id)


@contextmanager
def embedded_worker(concurrency: int = EMBEDDED_CONCURRENCY) -> Iterator[Any]:
    """A worker thread pool inside this process, on the in-memory broker (engine/transport/embedded.py)."""
    from noetl_celery.app import app, configure
    from noetl_celery.engine.transport import embedded

    settings = noetl_settings.load()
    configure(app, settings, embedded=True)
    with embedded.worker_thread_pool(app, settings, concurrency) as worker:
        yield worker


INTERRUPTED_REASON = "interrupted: Ctrl-C on the command that ran it"
TIMED_OUT_REASON = "timed out: still running after --timeout {timeout:g} s"


def run_embedded(
    plan: Plan, timeout: float | None = None, on_poll: Callable[[int], None] | None = None
) -> dict[str, Any]:
    """Run a playbook to completion with an embedded worker; returns the final status.

    The execution lives only as long as this process runs it: on Ctrl-C it is cancelled and
    Interrupted is raised; when `timeout` runs out it is cancelled too, and the status returned
    carries `"timed_out": True`."""
    settings = noetl_settings.load()
    ensure_schema(settings.database_url)
    return _run_here(settings, lambda: submit(plan, settings), timeout, on_poll)


def resume_embedded(
    execution_id: int,
    timeout: float | None = None,
    on_poll: Callable[[int], None] | None = None,
    on_resumed: Callable[[int], None] | None = None,
) -> dict[str, Any]:
    """`resume` without a broker: resume the execution with an embedded worker, as `run` runs
    one, and follow it to its end (`on_resumed` is told the new epoch once it is recorded);
    returns the final status. Ctrl-C and `timeout` cancel it, as in `run_embedded`."""
    settings = noetl_settings.load()
    ensure_schema(settings.database_url)

    def start() -> int:
        epoch = resume(settings, execution_id)
        if on_resumed is not None:
            on_resumed(epoch)
        return execution_id

    return _run_here(settings, start, timeout, on_poll)


def rerun_embedded(
    execution_id: int,
    overrides: dict[str, Any] | None = None,
    *,
    from_step: str | None = None,
    latest: bool = False,
    timeout: float | None = None,
    on_poll: Callable[[int], None] | None = None,
    on_started: Callable[[int], None] | None = None,
) -> dict[str, Any]:
    """`rerun` without a broker: make the rerun and run it with an embedded worker to its end, as
    `run` does (`on_started` is told the new execution's id); returns its final status. A rerun
    that cannot be made is refused before the worker starts."""
    settings = noetl_settings.load()
    made = prepare_rerun(settings.database_url, execution_id, overrides or {}, from_step=from_step, latest=latest)

    def start() -> int:
        new_id = start_rerun(settings, *made)
        if on_started is not None:
            on_started(new_id)
        return new_id

    return _run_here(settings, start, timeout, on_poll)


def _run_here(
    settings: noetl_settings.Settings,
    start: Callable[[], int],
    timeout: float | None,
    on_poll: Callable[[int], None] | None,
) -> dict[str, Any]:
    """Start an execution (`start()` returns its id) on an embedded worker and wait for its end;
    on Ctrl-C or a timeout, cancel it before the worker stops (its attempts in flight are then
    recorded, nothing further is sent)."""
    url = settings.database_url
    execution_id: int | None = None
    with _ctrl_c_between_reads() as pressed, embedded_worker():
        try:
            execution_id = start()
            status = wait(url, execution_id, timeout, on_poll=_raising_when(pressed, on_poll))
        except KeyboardInterrupt:  # more Ctrl-C are noted only: neither half cancelled nor half stopped
            if execution_id is not None:
                cancel(url, execution_id, INTERRUPTED_REASON)
        else:
            if status["status"] == "running":
                cancel(url, execution_id, TIMED_OUT_REASON.format(timeout=timeout or 0))
                status = {**execution_status(url, execution_id), "timed_out": True}
            return status
    raise Interrupted(execution_id)


@contextmanager
def _ctrl_c_between_reads() -> Iterator[threading.Event]:
    """Ctrl-C noted, not raised where it lands: the KeyboardInterrupt comes between two reads of
    the store (`_raising_when`), never inside one. One raised inside a SQLite transaction could
    leave it open, holding the store's write lock, so that the cancel that follows waited out the
    busy timeout and failed ("database is locked").

    Once Ctrl-C was pressed the command is ending, and SIGINT stays noted only: the handler from
    before is not put back, so that a Ctrl-C pressed again while the execution is cancelled, the
    worker stops or the command says so is never raised there (it was, between the put-back and
    the command's own ignore, and the command then said it had been interrupted before the
    execution started). Without a Ctrl-C, the handler from before is put back."""
    pressed = threading.Event()
    restore = _on_sigint(lambda *_: pressed.set())
    try:
        yield pressed
    finally:
        if not pressed.is_set():
            restore()


def _raising_when(pressed: threading.Event, on_poll: Callable[[int], None] | None) -> Callable[[int], None]:
    """`on_poll` (called by `wait` between two reads), first raising KeyboardInterrupt once Ctrl-C
    was pressed."""

    def poll(execution_id: int) -> None:
        if pressed.is_set():
            raise KeyboardInterrupt
        if on_poll is not None:
            on_poll(execution_id)

    return poll


def _on_sigint(handler: Any) -> Callable[[], None]:
    """`handler` for SIGINT from now on; returns what puts the previous one back. Only the main
    thread receives signals: elsewhere nothing changes."""
    import signal

    if threading.current_thread() is not threading.main_thread():
        return lambda: None
    previous = signal.signal(signal.SIGINT, handler)

    def restore() -> None:
        signal.signal(signal.SIGINT, previous)

    return restore


def _safe_url(url: str) -> str:
    from noetl_celery.store.check import safe_url

    return safe_url(url)


# --- the playbook catalog ------------------------------------------------------------------


class _StoreCatalog:
    """Catalog lookups in the store (a store that cannot be read has no entries); `paths()` lists
    the registered paths, for the nearest one a missing sub-playbook path suggests."""

    def __init__(self, database_url: str):
        self.database_url = database_url

    def __call__(self, path: str) -> resolve.Found | None:
        try:
            ensure_schema(self.database_url)
            with transaction(self.database_url) as conn:
                entry = find_playbook(conn, path)
        except Exception:  # an unreachable store: fall back to the files
            return None
        if entry is None:
            return None
        return resolve.Found(path=path, source=entry["source_file"] or f"catalog:{path}", text=entry["content"])

    def paths(self) -> list[str]:
        try:
            ensure_schema(self.database_url)
            with transaction(self.database_url) as conn:
                return [entry["path"] for entry in list_playbooks(conn)]
        except Exception:  # an unreachable store lists nothing
            return []


def catalog(database_url: str) -> resolve.Catalog:
    """Catalog lookups in the store (a store that cannot be read has no entries)."""
    return _StoreCatalog(database_url)


def register(files: list[str], database_url: str) -> list[Plan]:
    """Validate each file and store it in the catalog under its metadata.path."""
    return [
        register_text(Path(file).read_text(encoding="utf-8"), database_url, file, str(Path(file).resolve()))
        for file in files
    ]


def register_text(text: str, database_url: str, source: str, source_file: str | None = None) -> Plan:
    """Validate a playbook's text (`source` names it in problems) and store it in the catalog
    under its metadata.path; `source_file` is recorded with it (a file's absolute path)."""
    plan = compile_playbook(source, text=text, catalog=catalog(database_url))
    if not plan.path:
        raise PlaybookError(
            [Problem(source, None, "metadata.path", "a registered playbook needs metadata.path (its catalog path)")]
        )
    ensure_schema(database_url)
    with transaction(database_url) as conn:
        register_playbook(conn, path=plan.path, name=plan.name, content=text, source_file=source_file)
    return plan


def catalog_entries(database_url: str) -> list[dict[str, Any]]:
    """The registered playbooks (path, name, source_file, registered_at), by path."""
    ensure_schema(database_url)
    with transaction(database_url) as conn:
        return list_playbooks(conn)


def compile_registered(path: str, overrides: dict[str, Any], database_url: str) -> Plan:
    """The plan of the playbook registered at catalog path `path`, its workload deep-merged with
    `overrides` (as `--set` does). Only the catalog is read, never a file of this machine."""
    lookup = catalog(database_url)
    found = lookup(path)
    if found is None:
        raise PlaybookError([Problem(path, None, "path", f"no playbook registered at catalog path {path!r}")])
    return compile_playbook(found.source, text=found.text, overrides=overrides, catalog=lookup)


def rerun(
    settings: noetl_settings.Settings,
    execution_id: int,
    overrides: dict[str, Any] | None = None,
    *,
    from_step: str | None = None,
    latest: bool = False,
) -> int:
    """A new execution made from execution `execution_id` (engine/recovery/rerun.py), which is left as it
    is; returns the new id. Its workload is the old one deep-merged with `overrides`; its plan the
    old execution's, or with `latest` the playbook registered at its catalog path now. With
    `from_step` the steps that completed before that step's last run keep their results (copied,
    not run) and the run starts at it; without, it starts at the entry step. `noetl-celery rerun`,
    the API's rerun and the dashboard's call this. Raises RerunRefused when it cannot be made."""
    made = prepare_rerun(settings.database_url, execution_id, overrides or {}, from_step=from_step, latest=latest)
    return start_rerun(settings, *made)


def start_rerun(settings: noetl_settings.Settings, plan: Plan, made: Any) -> int:
    """Create the rerun `prepare_rerun` made, decide its start and publish it; returns its id."""
    from noetl_celery.engine.recovery import rerun as reruns

    new_id, dispatches = create_started(
        plan, settings.database_url, lambda conn, state, row: reruns.start(conn, state, row, made)
    )
    _publish_start(settings, new_id, dispatches)
    return new_id


def prepare_rerun(
    database_url: str, execution_id: int, overrides: dict[str, Any], *, from_step: str | None, latest: bool
) -> tuple[Plan, Any]:
    """The plan of a rerun of `execution_id` and what it starts from (engine.recovery.rerun.Rerun)."""
    from noetl_celery.dsl import deep_merge
    from noetl_celery.engine.recovery import rerun as reruns

    ensure_schema(database_url)
    with transaction(database_url) as conn:
        old = reruns.old_execution(conn, execution_id)
    workload = deep_merge(old["workload"] or {}, overrides)
    made = reruns.Rerun(rerun_of=execution_id, from_step=from_step)
    if latest:
        path = old["playbook_path"]
        with transaction(database_url) as conn:
            entry = find_playbook(conn, path) if path else None
        if entry is None:
            where = f"at its path {path!r}" if path else "(its playbook has no metadata.path)"
            raise reruns.RerunRefused(
                f"latest: execution {execution_id}'s playbook is not registered in the catalog {where}", "latest"
            )
        plan = compile_registered(path, workload, database_url)
        made.plan_source, made.registered_at = "catalog", entry["registered_at"].isoformat()
    else:
        plan = Plan.model_validate(old["plan"])
        plan = plan.model_copy(update={"workload": workload})
    if from_step is not None:
        with transaction(database_url) as conn:
            reruns.seed(conn, old, plan, made)
    return plan, made


def cleanup(database_url: str, older_than_minutes: float, dry_run: bool, reason: str | None = None) -> list[int]:
    """Top-level executions running for more than `older_than_minutes`: cancelled (with their
    children) unless `dry_run`; returns their ids."""
    from datetime import timedelta

    ensure_schema(database_url)
    with transaction(database_url) as conn:
        stuck = running_since(conn, utcnow() - timedelta(minutes=older_than_minutes))
    if not dry_run:
        for execution_id in stuck:
            cancel(database_url, execution_id, reason or f"cleanup: running for more than {older_than_minutes:g} min")
    return stuck


def execution_tree(database_url: str, limit: int = 20) -> list[tuple[int, dict[str, Any]]]:
    """Recent top-level executions, each followed by its children (depth, row), depth first."""
    ensure_schema(database_url)
    out: list[tuple[int, dict[str, Any]]] = []
    with transaction(database_url) as conn:

        def walk(row: dict[str, Any], depth: int) -> None:
            out.append((depth, row))
            for child in child_executions(conn, row["execution_id"]):
                walk(child, depth + 1)

        for row in list_executions(conn, limit, top_level=True):
            walk(row, 0)
    return out
