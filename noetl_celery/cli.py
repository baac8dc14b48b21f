"""The management command `noetl-celery`: parses arguments, calls runner/compiler, prints.

Exit codes: 0 completed (or valid), 1 the execution failed, 2 the playbook, the arguments or the
environment are invalid, or the event store or the broker cannot be used (one line saying what
and where; the traceback only with --debug), 3 still running when --timeout ran out (`run` and
an embedded `resume` then cancel it), 4 the execution was cancelled (`status`, `run`, `submit
--wait`; `cancel` itself exits 0), 5 detached (Ctrl-C on `submit --wait`: the execution goes on),
130 interrupted (Ctrl-C on `run` or an embedded `resume`: the execution was cancelled).
Everything printed passes through the secret registry's mask.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

import click

from noetl_celery.config import secret_registry
from noetl_celery.config import settings as noetl_settings
from noetl_celery.core.errors import (
    BrokerUnavailable,
    ConfigurationError,
    ExecutionNotFound,
    Interrupted,
    PlaybookError,
    Problem,
)
from noetl_celery.core.lazy import lazy_module
from noetl_celery.engine.transport.broker import check_broker_url
from noetl_celery.observe import log_format
from noetl_celery.store.check import describe_infrastructure_error, safe_url

if TYPE_CHECKING:
    from noetl_celery import compiler, runner
    from noetl_celery.dsl.plan import Plan
    from noetl_celery.store import status as store_status
else:
    runner = lazy_module("noetl_celery.runner")  # SQLAlchemy and Celery only for the commands that use them
    store_status = lazy_module("noetl_celery.store.status")  # a command that only reads: no compiler
    compiler = lazy_module("noetl_celery.compiler")

EXIT_OK, EXIT_FAILED, EXIT_INVALID, EXIT_RUNNING, EXIT_CANCELLED = 0, 1, 2, 3, 4
EXIT_DETACHED = 5  # Ctrl-C on submit --wait: stopped following, the execution goes on
EXIT_INTERRUPTED = 130  # Ctrl-C on run (or an embedded resume): the execution was cancelled
SUMMARY_WIDTH = 70  # characters of a result/error shown per event row in the table


def _parse_sets(values: tuple[str, ...]) -> dict[str, Any]:
    """`--set a.b=1` -> {"a": {"b": 1}}; values are read as YAML scalars (numbers, booleans, lists)."""
    from noetl_celery.dsl.set_values import parse_assignments  # the compiler only for the commands that compile

    try:
        return parse_assignments(values)
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="--set") from None


class _CatalogLookup:
    """A catalog lookup in the store, which is opened only when a playbook names one (a playbook
    of plain files validates without SQLAlchemy or a store); `paths()` (the registered paths, for
    the nearest one a missing sub-playbook suggests) only after a lookup found nothing."""

    def __call__(self, path: str) -> Any:
        return runner.catalog(noetl_settings.load().database_url)(path)

    def paths(self) -> list[str]:
        return list(runner.catalog(noetl_settings.load().database_url).paths())  # type: ignore[attr-defined]


_catalog_lookup = _CatalogLookup()


def _compile(path: str, sets: tuple[str, ...] = (), strict_names: bool = False) -> Plan:
    """A playbook file, or the catalog path of a registered playbook (`noetl-celery register`).
    An unknown key or a `{{ name }}` the playbook never gives is printed as a warning (`file:line: path: warning:
    ...`, on stderr), or is a problem with `strict_names` (or where templates render strictly)."""
    warnings: list[Problem] = []
    try:
        plan = compiler.compile_source(path, _parse_sets(sets), _catalog_lookup, warnings)
        if strict_names and warnings:
            raise PlaybookError(warnings)
        for warning in warnings:
            echo(str(dataclasses.replace(warning, message=f"warning: {warning.message}")), err=True)
        return plan
    except PlaybookError as exc:
        for problem in exc.problems:
            echo(str(problem), err=True)
        sys.exit(EXIT_INVALID)
    except OSError as exc:
        echo(f"{path}: {exc.strerror or exc}", err=True)
        sys.exit(EXIT_INVALID)


def echo(text: str, err: bool = False) -> None:
    """Print one line of output with every configured secret masked. Written through sys.stdout /
    sys.stderr as they are: click's own text wrapper of the binary stream asks a file for its
    position, which fails (OSError: Illegal seek) while an embedded attempt has pointed file
    descriptor 2 at its masking pipe (fd_masking.py) and stderr was redirected to a file."""
    click.echo(secret_registry.mask_text(text), file=sys.stderr if err else sys.stdout)


def _webhook_line(hook: dict[str, Any]) -> str:
    """`status`'s line about the execution's webhook delivery."""
    line = f"  webhook: {hook['state']} ({hook['attempts']} attempt{'s' if hook['attempts'] != 1 else ''}"
    if hook.get("url"):
        line += f" to {hook['url']}"
    line += ")"
    if hook["state"] == "retrying" and hook.get("next_at"):
        line += f", next try at {hook['next_at']}"
    if hook["state"] != "delivered" and hook.get("last_error"):
        line += f"; last error: {hook['last_error']}"
    return line


def _print_json(value: Any) -> None:
    echo(json.dumps(value, indent=2, default=str))


def _exit_for(status: dict[str, Any]) -> int:
    return {"completed": EXIT_OK, "failed": EXIT_FAILED, "cancelled": EXIT_CANCELLED}.get(
        status["status"], EXIT_RUNNING
    )


def _print_outcome(status: dict[str, Any], as_json: bool) -> None:
    if as_json:
        _print_json(status)
        return
    echo(f"execution {status['execution_id']} ({status['playbook']}): {status['status']}")
    if status["status"] == "cancelled":
        echo(f"  cancelled: {_error_message(status.get('error') or 'cancelled')}")
    elif status.get("error"):
        echo(f"  failed step: {status.get('failed_step')}")
        echo(f"  error: {json.dumps(status['error'], default=str)[:500]}")
    for step, result in status.get("results", {}).items():
        echo(f"  {step}: {_summary(result)}")


def _summary(value: Any) -> str:
    text = json.dumps(value, default=str) if value is not None else ""
    return text if len(text) <= SUMMARY_WIDTH else text[: SUMMARY_WIDTH - 3] + "..."


_options = {"debug": False}


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="noetl_celery")
@click.option("--debug", is_flag=True, help="Show the traceback of an infrastructure error.")
def cli(debug: bool) -> None:
    """Run NoETL playbooks on Celery. Embedded default: SQLite under NOETL_HOME (~/.noetl) and an
    in-process worker; set NOETL_BROKER_URL and NOETL_DATABASE_URL for real workers."""
    _options["debug"] = debug


@cli.command()
@click.argument("playbook", type=click.Path(dir_okay=False))
@click.option("--set", "sets", multiple=True, metavar="KEY=VALUE", help="A workload value the run will give.")
@click.option(
    "--strict",
    is_flag=True,
    help="An unknown key, or a {{ name }} the playbook never gives, is a problem, not a warning (exit 2).",
)
def validate(playbook: str, sets: tuple[str, ...], strict: bool) -> None:
    """Check a playbook; prints `file:line: path: message` per problem (exit 2). A key this engine
    does not know (ignored, as NoETL ignores it) and a `{{ name }}` that is no step, task,
    workload, ctx, vars or built-in name of the playbook are printed as warnings with the nearest
    name (problems with --strict or strict templates)."""
    plan = _compile(playbook, sets, strict_names=strict)
    echo(f"{playbook}: valid {plan.dialect} playbook '{plan.name}' with {len(plan.steps)} steps")


@cli.command(name="compile")
@click.argument("playbook", type=click.Path(dir_okay=False))
@click.option("--json", "as_json", is_flag=True, help="Print the plan as JSON.")
@click.option("--set", "sets", multiple=True, metavar="KEY=VALUE", help="Override a workload value.")
def compile_cmd(playbook: str, as_json: bool, sets: tuple[str, ...]) -> None:
    """Show the plan: steps, task signatures, policies and routing."""
    plan = _compile(playbook, sets)
    settings = noetl_settings.load()
    described = compiler.describe(plan, task_queue=settings.task_queue, event_queue=settings.event_queue)
    if as_json:
        _print_json({**described, "plan": plan.model_dump(mode="json")})
        return
    echo(
        f"{described['playbook']} ({described['dialect']}, {described['api_version']}), "
        f"entry: {described['entry_step']}"
    )
    if described["tags"]:
        echo(f"tags: {', '.join(described['tags'])}")
    for step in described["steps"]:
        echo(
            f"- step {step['step']}"
            + (f"  [loop {step['loop']}]" if step["loop"] else "")
            + (f"  [tags: {', '.join(step['tags'])}]" if step["tags"] else "")
        )
        tasks = step["tasks"]
        if isinstance(tasks, str):
            echo(f"    {tasks}")
        else:
            for task in tasks:
                sig = task["signature"]
                echo(
                    f"    task {task['label']} ({task['kind']}): {sig['task']} queue={sig['queue']} "
                    f"shadow={sig['shadow']}" + (f" sink={task['sink']}" if task["sink"] else "")
                )
                for line in task["policy"]:
                    echo(f"      policy: {line}")
        if step.get("result"):
            keeps = f"keeps {step['result']['select']}" if step["result"]["select"] else "kept whole"
            hints = step["result"]["advisory"]
            echo(f"    result: {keeps}" + (f"; advisory hints {hints}" if hints else ""))
        for arc in step["next"]["arcs"]:
            cond = f" when {'not ' if arc['negate'] else ''}{arc['when']}" if arc["when"] is not None else ""
            echo(f"    next ({step['next']['mode']}) -> {arc['step']}{cond}")
        if step["join"]:
            echo(f"    branches join at {step['join']}")


@cli.command()
@click.argument("playbook", type=click.Path(dir_okay=False))
@click.option("--set", "sets", multiple=True, metavar="KEY=VALUE", help="Override a workload value.")
@click.option("--json", "as_json", is_flag=True, help="Print the outcome as one JSON object.")
@click.option("--timeout", type=float, default=None, help="Give up waiting after this many seconds.")
@click.option("--quiet", "-q", is_flag=True, help="No progress while it runs (only the outcome).")
def run(playbook: str, sets: tuple[str, ...], as_json: bool, timeout: float | None, quiet: bool) -> None:
    """Run a playbook to completion with an in-process worker (embedded default)."""
    plan = _compile(playbook, sets)
    progress = _progress(noetl_settings.load().database_url, quiet, as_json)
    try:
        status = runner.run_embedded(plan, timeout=timeout, on_poll=progress.poll if progress else None)
    except (KeyboardInterrupt, Interrupted) as exc:
        _interrupted(getattr(exc, "execution_id", None))
    _end_of_run(status, progress, as_json, timeout)


def _interrupted(execution_id: int | None) -> NoReturn:
    """Ctrl-C on `run` or an embedded `resume`: the execution was cancelled (exit 130)."""
    import signal

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the command is ending: more Ctrl-C change nothing
    if execution_id is None:
        echo("\ninterrupted before the execution started", err=True)
    else:
        echo(
            f"\ninterrupted: execution {execution_id} cancelled; `noetl-celery resume {execution_id}` "
            "continues it from the steps that did not complete",
            err=True,
        )
    sys.exit(EXIT_INTERRUPTED)


def _end_of_run(status: dict[str, Any], progress: Any, as_json: bool, timeout: float | None) -> NoReturn:
    """The outcome of an execution this process ran; a timed out one was cancelled (exit 3)."""
    if progress:
        progress.close(status["execution_id"])
    _print_outcome(status, as_json)
    if status.get("timed_out"):
        echo(
            f"timed out after {timeout:g} s: execution {status['execution_id']} cancelled; "
            f"`noetl-celery resume {status['execution_id']}` continues it",
            err=True,
        )
        sys.exit(EXIT_RUNNING)
    sys.exit(_exit_for(status))


@cli.command()
@click.argument("playbook", type=click.Path(dir_okay=False))
@click.option("--set", "sets", multiple=True, metavar="KEY=VALUE", help="Override a workload value.")
@click.option("--wait", is_flag=True, help="Follow the execution to its end.")
@click.option("--json", "as_json", is_flag=True, help="Print the outcome as one JSON object.")
@click.option("--timeout", type=float, default=None, help="With --wait: give up after this many seconds.")
@click.option("--quiet", "-q", is_flag=True, help="With --wait: no progress while it runs.")
def submit(playbook: str, sets: tuple[str, ...], wait: bool, as_json: bool, timeout: float | None, quiet: bool) -> None:
    """Enqueue a playbook on the configured broker for `celery -A noetl_celery worker` processes."""
    plan = _compile(playbook, sets)
    settings = noetl_settings.load()
    try:
        check_broker_url(noetl_settings.require_broker(settings))
    except ConfigurationError as exc:
        echo(f"error: {exc}", err=True)
        sys.exit(EXIT_INVALID)
    try:
        execution_id = runner.submit(plan, settings)
    except BrokerUnavailable as exc:
        echo(f"error: {exc}", err=True)
        sys.exit(EXIT_INVALID)
    if not wait:
        if as_json:
            _print_json({"execution_id": execution_id, "status": "running", "error": None, "results": {}})
        else:
            echo(f"submitted execution {execution_id}")
        return
    # at once, so that another terminal can follow it; on stderr, the JSON output keeps its shape
    echo(f"submitted execution {execution_id}; following it (Ctrl-C detaches, the execution goes on)", err=True)
    progress = _progress(settings.database_url, quiet, as_json)
    try:
        status = runner.wait(settings.database_url, execution_id, timeout, on_poll=progress.poll if progress else None)
    except KeyboardInterrupt:
        echo(
            f"\ndetached: execution {execution_id} goes on. Follow it with `noetl-celery status "
            f"{execution_id}` or `noetl-celery events {execution_id} --follow`; stop it with "
            f"`noetl-celery cancel {execution_id}`",
            err=True,
        )
        sys.exit(EXIT_DETACHED)
    if progress:
        progress.close(execution_id)
    _print_outcome(status, as_json)
    sys.exit(_exit_for(status))


def _progress(database_url: str, quiet: bool, as_json: bool) -> Any:
    """Live progress on stderr: redrawn on a terminal, plain lines otherwise; none with --quiet
    (nor with --json, unless stderr is a terminal)."""
    from noetl_celery.observe.watch import Progress

    if quiet or (as_json and not sys.stderr.isatty()):
        return None
    return Progress(database_url, sys.stderr)


def _execution_or_exit(fn: Any, execution_id: int) -> Any:
    try:
        return fn(noetl_settings.load().database_url, execution_id)
    except ExecutionNotFound as exc:
        echo(f"error: {exc}", err=True)
        sys.exit(EXIT_INVALID)


@cli.command()
@click.argument("execution_id", type=int)
@click.option("--json", "as_json", is_flag=True)
def status(execution_id: int, as_json: bool) -> None:
    """The state of an execution, read from the event store."""
    from noetl_celery.observe.watch import status_extras

    result = _execution_or_exit(store_status.execution_status, execution_id)
    extras = status_extras(noetl_settings.load().database_url, execution_id)
    if as_json:
        _print_json({**result, **extras})
        sys.exit(_exit_for(result))
    _print_outcome(result, as_json)
    if result.get("scheduled"):
        echo(f"  started by schedule {result['scheduled']['schedule']} (fire time {result['scheduled']['fire_time']})")
    if result.get("webhook"):
        echo(_webhook_line(result["webhook"]))
    progress = extras["progress"]
    echo(f"  progress: {progress['done']}/{progress['total']} units")
    from noetl_celery.store.views import loop_count

    for loop in extras["loops"]:
        rate = f", {loop['rate']}/s" if loop["rate"] else ""
        echo(
            f"  loop {loop['step']}: {loop['status']} {loop_count(loop)} "
            f"({loop['succeeded']} ok, {loop['failed']} failed, {loop['in_flight']} in flight{rate})"
        )
    failure = extras["failure"]
    if failure:
        where = f" iteration {failure['iteration']}" if failure["iteration"] is not None else ""
        echo(
            f"  failing attempt: step {failure['step']}{where} attempt {failure['attempt']}"
            + (f" (Celery task {failure['queue_id']})" if failure.get("queue_id") else "")
        )
        if failure.get("attempt_error"):
            echo(f"    error: {_error_message(failure['attempt_error'])}")
        if failure.get("element") is not None:
            echo(f"    element: {json.dumps(failure['element'], default=str)[:INPUT_WIDTH]}")
        echo(f"    input: {json.dumps(failure['input'], default=str)[:INPUT_WIDTH]}")
        for line in _output_lines(failure, "    "):
            echo(line)
    sys.exit(_exit_for(result))


INPUT_WIDTH = 2000  # characters of a failing attempt's rendered input shown by `status`
OUTPUT_LINES = 20  # lines of an attempt's stdout / stderr / log shown per stream


def _output_lines(holder: dict[str, Any], indent: str) -> list[str]:
    """What an attempt wrote (meta stdout, stderr, log records), `stream| line` each, at most
    OUTPUT_LINES lines per stream (`--json` shows them whole)."""
    lines: list[str] = []
    for stream in ("stdout", "stderr", "log"):
        value = holder.get(stream)
        if not value:
            continue
        text = value if isinstance(value, list) else str(value).splitlines()
        for line in text[:OUTPUT_LINES]:
            lines.append(f"{indent}{stream}| {line}")
        if len(text) > OUTPUT_LINES:
            lines.append(f"{indent}{stream}| ... {len(text) - OUTPUT_LINES} more lines (--json shows them)")
    return lines


def _error_message(error: Any) -> str:
    if isinstance(error, dict) and error.get("message"):
        return str(error["message"])
    return json.dumps(error, default=str)[:500]


@cli.command()
@click.argument("execution_id", type=int)
@click.option("--json", "as_json", is_flag=True, help="Print the event rows as a JSON list.")
@click.option("--follow", "-f", is_flag=True, help="Keep printing new rows until the execution ends.")
@click.option("--limit", type=click.IntRange(min=1), default=None, help="At most this many rows.")
@click.option("--type", "types", multiple=True, metavar="EVENT_TYPE", help="Only rows of this type (repeatable).")
@click.option("--step", "steps", multiple=True, metavar="STEP", help="Only rows of this step (repeatable).")
@click.option(
    "--since",
    default=None,
    metavar="ID|TIME|AGO",
    help="Only rows after event id ID, or created at or after TIME (ISO 8601) or AGO (e.g. 90s, 10m, 2h) ago.",
)
def events(
    execution_id: int,
    as_json: bool,
    follow: bool,
    limit: int | None,
    types: tuple[str, ...],
    steps: tuple[str, ...],
    since: str | None,
) -> None:
    """The event log of an execution, in order, written as it is read (any size, bounded memory)."""
    from noetl_celery.observe.watch import follow_events, stream_events

    after_id, since_time = _since(since)
    url = noetl_settings.load().database_url
    if follow:
        _execution_or_exit(store_status.execution_status, execution_id)
        if not as_json:
            echo(EVENTS_HEADER)
        shown = 0
        try:
            for row in follow_events(url, execution_id):
                if not _event_matches(row, types, steps, after_id, since_time):
                    continue
                _echo_event(row, as_json)
                shown += 1
                if limit is not None and shown >= limit:
                    break
        except KeyboardInterrupt:
            sys.exit(EXIT_DETACHED)
        return
    rows = stream_events(url, execution_id, types=types, steps=steps, after_id=after_id, since=since_time, limit=limit)
    try:
        first = next(rows, None)
    except ExecutionNotFound as exc:
        echo(f"error: {exc}", err=True)
        sys.exit(EXIT_INVALID)
    if as_json:  # the same text as json.dumps(rows, indent=2), written row by row
        if first is None:
            echo("[]")
            return
        click.echo("[")
        for n, row in enumerate(_chain(first, rows)):
            text = json.dumps(row, indent=2, default=str).replace("\n", "\n  ")
            click.echo(("," if n else "") + ("\n" if n else "") + secret_registry.mask_text("  " + text), nl=False)
        click.echo("\n]")
        return
    echo(EVENTS_HEADER)
    if first is not None:
        for row in _chain(first, rows):
            _echo_event(row, as_json=False)


def _chain(first: dict[str, Any], rest: Any) -> Any:
    yield first
    yield from rest


def _echo_event(row: dict[str, Any], as_json: bool) -> None:
    if as_json:
        echo(json.dumps(row, default=str))
        return
    echo(_event_line(row))
    for line in _output_lines(row.get("meta") or {}, "      "):
        echo(line)


AGO_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400}


def _since(value: str | None) -> tuple[int | None, Any]:
    """`--since`: an event id (rows after it), an ISO 8601 time, or a duration ago (90s, 10m, 2h,
    1d); returns (after id, since time)."""
    from datetime import UTC, datetime, timedelta

    if value is None:
        return None, None
    text = value.strip()
    if text.isdigit():
        return int(text), None
    unit = AGO_UNITS.get(text[-1:].lower())
    if unit is not None:
        try:
            return None, datetime.now(UTC) - timedelta(seconds=float(text[:-1]) * unit)
        except ValueError:
            pass
    try:
        moment = datetime.fromisoformat(text)
    except ValueError:
        raise click.BadParameter(
            f"expected an event id, an ISO 8601 time or a duration such as 10m, got {value!r}", param_hint="--since"
        ) from None
    return None, moment if moment.tzinfo is not None else moment.replace(tzinfo=UTC)


def _event_matches(
    row: dict[str, Any], types: tuple[str, ...], steps: tuple[str, ...], after_id: int | None, since: Any
) -> bool:
    """The --type/--step/--since filters applied to a row `events --follow` read."""
    if types and row["event_type"] not in types:
        return False
    if steps and row["step"] not in steps:
        return False
    if after_id is not None and row["id"] <= after_id:
        return False
    if since is not None:
        created = row["created_at"]
        if created.tzinfo is None:
            created = created.replace(tzinfo=since.tzinfo)
        if created < since:
            return False
    return True


EVENTS_HEADER = f"{'#':>5} {'time':12} {'event':20} {'step':22} {'task':16} {'it':>4} {'att':>3} {'ms':>8}  detail"


def _event_line(row: dict[str, Any]) -> str:
    if row["error"]:
        detail = _error_message(row["error"])  # an error is shown whole: it is what one looks for
    else:
        detail = _summary(row["result"] or row["meta"])
    return (
        f"{row['id']:>5} {row['created_at'].strftime('%H:%M:%S.%f')[:12]:12} {row['event_type']:20} "
        f"{(row['step'] or '')[:22]:22} {(row['task'] or '')[:16]:16} "
        f"{'' if row['iteration'] is None else row['iteration']:>4} {row['attempt'] or '':>3} "
        f"{'' if row['duration_ms'] is None else round(row['duration_ms'], 1):>8}  {detail}"
    )


@cli.command()
@click.argument("execution_id", type=int)
@click.option("--reason", default=None, help="Recorded in the execution.cancelled row.")
def cancel(execution_id: int, reason: str | None) -> None:
    """Cancel a running execution and its child executions (exit 0, also when it had already
    ended; 2 when there is no such execution)."""
    cancelled = _execution_or_exit(lambda url, eid: runner.cancel(url, eid, reason), execution_id)
    status = _execution_or_exit(store_status.execution_status, execution_id)
    if cancelled:
        children = [c for c in cancelled if c != execution_id]
        echo(f"execution {execution_id}: cancelled" + (f" (and {len(children)} child executions)" if children else ""))
    else:
        echo(f"execution {execution_id}: already {status['status']}, nothing to cancel")
    sys.exit(EXIT_OK)


@cli.command()
@click.argument("execution_id", type=int)
@click.option(
    "--from-store", "from_store", default=None, metavar="URL", help="The store to read (default NOETL_DATABASE_URL)."
)
@click.option("--json", "as_json", is_flag=True, help="Print the report as one JSON object.")
def replay(execution_id: int, from_store: str | None, as_json: bool) -> None:
    """Decide a recorded execution again with this version's code, in-process (no tool runs,
    nothing is written to the store), and report the first decision that differs: exit 0 when
    none does, 1 when one does, 2 when it cannot be replayed."""
    from noetl_celery import replay as replayer

    url = from_store or noetl_settings.load().database_url
    try:
        report = replayer.replay(url, execution_id)
    except (ExecutionNotFound, replayer.ReplayError) as exc:
        echo(f"error: {exc}", err=True)
        sys.exit(EXIT_INVALID)
    if as_json:
        _print_json(report.to_dict())
    else:
        for line in replayer.describe(report):
            echo(line)
    sys.exit(EXIT_OK if report.difference is None else EXIT_FAILED)


@cli.command()
@click.argument("execution_id", type=int)
@click.option("--json", "as_json", is_flag=True, help="Embedded: print the outcome as one JSON object.")
@click.option("--timeout", type=float, default=None, help="Embedded: give up (and cancel) after this many seconds.")
@click.option("--quiet", "-q", is_flag=True, help="Embedded: no progress while it runs.")
def resume(execution_id: int, as_json: bool, timeout: float | None, quiet: bool) -> None:
    """Continue a failed or cancelled execution from the steps that did not complete (the same
    execution, in its next epoch). With a broker, its workers run it and this returns at once;
    on the embedded default (no NOETL_BROKER_URL) it runs here to its end, as `run` does."""
    from noetl_celery.engine.recovery.resume import ResumeRefused

    settings = noetl_settings.load()
    if settings.broker_url is None:
        from noetl_celery.store.db import ensure_schema

        ensure_schema(settings.database_url)
        progress = _progress(settings.database_url, quiet, as_json)
        if progress:
            progress.skip_history(execution_id)
        try:
            status = runner.resume_embedded(
                execution_id,
                timeout=timeout,
                on_poll=progress.poll if progress else None,
                on_resumed=lambda epoch: echo(f"execution {execution_id}: resumed (epoch {epoch})", err=True),
            )
        except (ExecutionNotFound, ResumeRefused) as exc:
            echo(f"error: {exc}", err=True)
            sys.exit(EXIT_INVALID)
        except (KeyboardInterrupt, Interrupted) as exc:
            _interrupted(getattr(exc, "execution_id", None))
        _end_of_run(status, progress, as_json, timeout)
    try:
        epoch = runner.resume(settings, execution_id)
    except (ExecutionNotFound, ConfigurationError, BrokerUnavailable, ResumeRefused) as exc:
        echo(f"error: {exc}", err=True)
        sys.exit(EXIT_INVALID)
    echo(f"execution {execution_id}: resumed (epoch {epoch})")


@cli.command()
@click.argument("execution_id", type=int)
@click.option(
    "--from", "from_step", default=None, metavar="STEP", help="Start at STEP; the steps before it keep their results."
)
@click.option("--set", "sets", multiple=True, metavar="KEY=VALUE", help="Override a parameter of the old execution.")
@click.option("--latest", is_flag=True, help="The playbook registered at its catalog path now, not the stored plan.")
@click.option("--json", "as_json", is_flag=True, help="Print the outcome (embedded) or the new id as one JSON object.")
@click.option("--timeout", type=float, default=None, help="Embedded: give up (and cancel) after this many seconds.")
@click.option("--quiet", "-q", is_flag=True, help="Embedded: no progress while it runs.")
def rerun(
    execution_id: int,
    from_step: str | None,
    sets: tuple[str, ...],
    latest: bool,
    as_json: bool,
    timeout: float | None,
    quiet: bool,
) -> None:
    """Run an execution again as a NEW execution that records `rerun_of` (the old one is left as
    it is): the whole playbook with the old parameters (overridden by --set), or with --from STEP
    from that step, the steps that completed before it keeping their results (copied, not run).
    `resume` instead continues the same execution with its stored plan. With a broker, its workers
    run it and this returns at once; on the embedded default it runs here to its end, as `run`."""
    from noetl_celery.engine.recovery.rerun import RerunRefused

    overrides = _parse_sets(sets)
    settings = noetl_settings.load()
    refused = (ExecutionNotFound, RerunRefused, PlaybookError, ConfigurationError, BrokerUnavailable)
    if settings.broker_url is None:
        from noetl_celery.store.db import ensure_schema

        ensure_schema(settings.database_url)
        progress = _progress(settings.database_url, quiet, as_json)
        try:
            status = runner.rerun_embedded(
                execution_id,
                overrides,
                from_step=from_step,
                latest=latest,
                timeout=timeout,
                on_poll=progress.poll if progress else None,
                on_started=lambda new_id: echo(f"execution {new_id}: rerun of {execution_id}", err=True),
            )
        except refused as exc:
            _refused(exc)
        except (KeyboardInterrupt, Interrupted) as exc:
            _interrupted(getattr(exc, "execution_id", None))
        _end_of_run(status, progress, as_json, timeout)
    try:
        new_id = runner.rerun(settings, execution_id, overrides, from_step=from_step, latest=latest)
    except refused as exc:
        _refused(exc)
    if as_json:
        _print_json({"execution_id": new_id, "rerun_of": execution_id, "from_step": from_step, "status": "running"})
    else:
        echo(f"execution {new_id}: rerun of {execution_id}" + (f" from step {from_step}" if from_step else ""))


def _refused(exc: Exception) -> NoReturn:
    if isinstance(exc, PlaybookError):
        for problem in exc.problems:
            echo(str(problem), err=True)
    else:
        echo(f"error: {exc}", err=True)
    sys.exit(EXIT_INVALID)


@cli.command()
@click.option("--revision", default="head", show_default=True)
def migrate(revision: str) -> None:
    """Create or upgrade the event store schema (alembic upgrade) on NOETL_DATABASE_URL; R is a
    revision (0002), its file name or head. Only upgrades: a store past R is refused (exit 2)."""
    from noetl_celery.store.db import upgrade

    settings = noetl_settings.load()
    before, after = upgrade(settings.database_url, revision)
    where = safe_url(settings.database_url)
    if before == after:
        echo(f"event store at {where} is at revision {after}: nothing to do")
    else:
        echo(f"event store at {where} is at revision {after} (was {before or 'empty'})")


@cli.command()
@click.argument("directory", default="playbooks", type=click.Path(file_okay=False))
@click.option("--force", is_flag=True, help="Overwrite files of the same name that differ.")
def examples(directory: str, force: bool) -> None:
    """Write the example playbooks the package ships into DIRECTORY (default ./playbooks), so
    that `noetl-celery run playbooks/hello_world.yaml` works from a wheel install too."""
    from importlib.resources import files

    shipped = sorted(
        (entry for entry in files("noetl_celery").joinpath("examples").iterdir() if entry.name.endswith(".yaml")),
        key=lambda entry: entry.name,
    )
    target = Path(directory)
    texts = {entry.name: entry.read_text(encoding="utf-8") for entry in shipped}
    differing = [
        name for name, text in texts.items() if (target / name).exists() and (target / name).read_text("utf-8") != text
    ]
    if differing and not force:
        echo(
            f"error: {target} already has {', '.join(differing)} with other contents; nothing written "
            "(--force overwrites them, or name another directory)",
            err=True,
        )
        sys.exit(EXIT_INVALID)
    try:
        target.mkdir(parents=True, exist_ok=True)
        for name, text in texts.items():
            (target / name).write_text(text, encoding="utf-8")
    except OSError as exc:
        echo(f"error: cannot write to {target}: {exc.strerror or exc}", err=True)
        sys.exit(EXIT_INVALID)
    echo(f"wrote {len(texts)} example playbooks to {target}/: {', '.join(texts)}")
    echo(f"try: noetl-celery run {target / 'hello_world.yaml'}")


@cli.command(name="config")
def config_cmd() -> None:
    """The effective settings (every NOETL_* variable or its default); passwords in URLs and
    credential values are shown as ***."""
    for name, value in noetl_settings.load().masked().items():
        echo(f"{name}={value}")


@cli.command(name="executions")
@click.option("--limit", default=20, show_default=True)
@click.option("--status", type=click.Choice(["running", "completed", "failed", "cancelled"]), default=None)
@click.option("--playbook", default=None, help="Only executions of this playbook (its metadata name).")
@click.option("--json", "as_json", is_flag=True, help="Print them as a JSON list.")
def executions_cmd(limit: int, status: str | None, playbook: str | None, as_json: bool) -> None:
    """The most recent executions, newest first, with duration and progress; without filters each
    is followed by its sub-playbook executions, indented."""
    from noetl_celery.observe.watch import executions, tree_progress
    from noetl_celery.store.db import ensure_schema

    url = noetl_settings.load().database_url
    ensure_schema(url)
    if as_json or status or playbook:
        rows = executions(url, status=status, playbook=playbook, limit=limit)
        if as_json:
            _print_json(rows)
            return
        tree = [(0, row) for row in rows]
    else:
        tree = [(depth, tree_progress(url, row)) for depth, row in runner.execution_tree(url, limit)]
    for depth, row in tree:
        indent = "  " * depth + ("└ " if depth else "")
        duration = "" if row["duration_s"] is None else f"{row['duration_s']:.1f}s"
        echo(
            f"{indent}{row['execution_id']}  {row['status']:10} {row['playbook']:30} {row['created_at']}  "
            f"{duration:>9}  {row['done']}/{row['total']}"
            + (f"  failed at {row['failed_step']}" if row["failed_step"] else "")
        )


SERVER_PORT = 8082  # NoETL's server port: NoETL's client finds this server where it looks by default
DASHBOARD_PORT = 8080


@cli.command()
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to bind (loopback by default).")
@click.option("--port", default=SERVER_PORT, show_default=True, type=int)
def server(host: str, port: int) -> None:
    """Serve the REST API (NoETL's routes, for NoETL's own client) and the dashboard in one
    process. On the embedded default (no NOETL_BROKER_URL) it runs an embedded worker too, so this
    command alone is a working service; with a broker, executions go to its workers. Writes need
    `Authorization: Bearer $NOETL_DASHBOARD_TOKEN`."""
    settings = noetl_settings.load()
    _stop_on_sigterm()  # a service manager's stop: as Ctrl-C (the embedded worker finishes its attempts)
    if settings.broker_url is not None:
        try:
            check_broker_url(settings.broker_url)
        except ConfigurationError as exc:
            echo(f"error: {exc}", err=True)
            sys.exit(EXIT_INVALID)
        _serve(host, port, "server", runs=True)
        return
    with runner.embedded_worker():
        _serve(host, port, "server (embedded worker)", runs=True)


@cli.command()
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to bind (loopback by default).")
@click.option("--port", default=DASHBOARD_PORT, show_default=True, type=int)
def dashboard(host: str, port: int) -> None:
    """The server's dashboard and REST API over the event store (NOETL_DATABASE_URL), without an
    embedded worker: on the embedded default, executions are started with `noetl-celery server`."""
    runs = noetl_settings.load().broker_url is not None
    _serve(host, port, "dashboard", runs=runs)


def _stop_on_sigterm() -> None:
    """SIGTERM (systemd, Docker, a Procfile runner) stops the server as Ctrl-C does."""
    import signal

    def stop(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, stop)


def _log_format(level: int) -> None:
    """NOETL_LOG_FORMAT=json: a command's log lines as JSON (its own output is unchanged); the
    server's lines (`level` INFO: its access log) with timestamps in either format."""
    try:
        style = noetl_settings.log_format()
    except ConfigurationError:
        return  # refused with its message where the settings are read
    if style == "json" or level <= log_format.SERVER_LEVEL:
        log_format.configure_process(style, level)


def _serve(host: str, port: int, what: str, *, runs: bool) -> None:
    from noetl_celery.dashboard.server import serve

    _log_format(log_format.SERVER_LEVEL)

    def ready() -> None:
        gc.freeze()  # the startup heap: no collection looks at it again (engine/transport/process.py)
        echo(f"{what} on http://{host}:{port}/ (Ctrl-C to stop)")

    try:
        with contextlib.suppress(KeyboardInterrupt):
            serve(host, port, on_ready=ready, runs=runs)
    except OSError as exc:
        echo(f"error: cannot listen on {host}:{port}: {exc.strerror or exc}", err=True)
        sys.exit(EXIT_INVALID)


@cli.command(name="prune")
@click.option("--older-than", "older_than", required=True, metavar="AGE", help="30d, 12h, 2w... (a bare number: days).")
@click.option(
    "--status",
    "statuses",
    multiple=True,
    type=click.Choice(["completed", "failed", "cancelled"]),
    help="Only executions that ended so (repeatable; default: all three).",
)
@click.option("--dry-run", is_flag=True, help="Count what would be removed; remove nothing.")
def prune_cmd(older_than: str, statuses: tuple[str, ...], dry_run: bool) -> None:
    """Delete the history of finished executions created and finished longer ago than AGE: every
    row of their trees (sub-playbooks included), in small batches of short transactions. Running
    executions, their parents and their sub-playbooks are never touched. On a partitioned event
    table (`store partition-events`), a partition whose executions may all go is dropped whole."""
    from noetl_celery.store import retention
    from noetl_celery.store.db import ensure_schema

    age = noetl_settings.parse_age(older_than, "--older-than")
    url = noetl_settings.load().database_url
    ensure_schema(url)
    pruned = retention.prune(url, age, statuses=statuses or retention.FINISHED, dry_run=dry_run)
    verb = "would remove" if dry_run else "removed"
    echo(f"{verb} {pruned.executions} execution(s) in {pruned.trees} tree(s), older than {age}:")
    for table, count in pruned.rows.items():
        echo(f"  {table}: {count} row(s)")
    for dropped in pruned.partitions:
        span = f"ids of {dropped.start:%Y-%m-%d} to {dropped.end:%Y-%m-%d}"
        drop = "would drop" if dry_run else "dropped"
        echo(f"  {drop} partition {dropped.name} ({span}): {dropped.rows} event row(s)")
    if pruned.skipped_running:
        echo(f"kept {pruned.skipped_running} tree(s) with a running execution")


@cli.group(name="store")
def store_group() -> None:
    """Maintenance of the event store's tables (PostgreSQL)."""


@store_group.command(name="partition-events")
@click.option(
    "--interval",
    type=click.Choice(["month", "week", "day"]),
    default="month",
    show_default=True,
    help="The period of execution ids one partition holds.",
)
@click.option("--undo", is_flag=True, help="Turn the partitioned table back into a plain one.")
@click.option("--dry-run", is_flag=True, help="Say what would be done; change nothing, block no writer.")
@click.option(
    "--lock-timeout",
    type=click.FloatRange(min=0.1),
    default=10.0,
    show_default=True,
    help="Seconds to wait for the table's lock before giving up (nothing changed).",
)
def partition_events_cmd(interval: str, undo: bool, dry_run: bool, lock_timeout: float) -> None:
    """Partition noetl_event by RANGE of execution id (one partition per month, week or day of
    the ids' time, and a default one), so that `prune` drops whole partitions. One transaction
    that locks noetl_event (ACCESS EXCLUSIVE) while it copies every row: decisions wait."""
    from sqlalchemy.exc import OperationalError

    from noetl_celery.store import partitions
    from noetl_celery.store.db import ensure_schema

    url = noetl_settings.load().database_url
    partitions.require_postgresql(url)
    ensure_schema(url)
    try:
        if undo:
            done = partitions.undo(url, dry_run=dry_run, lock_timeout=lock_timeout)
        else:
            done = partitions.convert(url, interval, dry_run=dry_run, lock_timeout=lock_timeout)
    except OperationalError as exc:
        if getattr(exc.orig, "pgcode", None) != "55P03":  # lock_not_available
            raise
        echo(f"error: noetl_event was not locked within {lock_timeout:g} s (another transaction holds it):", err=True)
        echo("nothing was changed; run it again when the store is quieter, or give a longer --lock-timeout", err=True)
        sys.exit(EXIT_INVALID)
    verb = ("would move" if dry_run else "moved") + f" {done.rows} event row(s)"
    if undo:
        echo(f"{verb} into a plain noetl_event; {'would remove' if dry_run else 'removed'} partitions:")
    else:
        made = "would create" if dry_run else "created"
        echo(f"{verb} into noetl_event partitioned by {interval}; {made} partitions:")
    for name in done.partitions:
        echo(f"  {name}")
    if not dry_run:
        echo(f"noetl_event was locked for {done.seconds:.1f} s")


@cli.command(name="register")
@click.argument("files", nargs=-1, required=True, type=click.Path(dir_okay=False, exists=True))
def register_cmd(files: tuple[str, ...]) -> None:
    """Validate playbooks and store them in the catalog under their metadata.path; `submit`, `run`
    and `kind: playbook` tasks then find them by that path."""
    try:
        plans = runner.register(list(files), noetl_settings.load().database_url)
    except PlaybookError as exc:
        for problem in exc.problems:
            echo(str(problem), err=True)
        sys.exit(EXIT_INVALID)
    for file, plan in zip(files, plans, strict=True):
        echo(f"registered {plan.path} ({plan.name}) from {file}")


@cli.command(name="catalog")
@click.option(
    "--json", "as_json", is_flag=True, help="One JSON object: {entries: [{path, name, source_file, registered_at}]}."
)
def catalog_cmd(as_json: bool) -> None:
    """The registered playbooks (`register`), by catalog path: name, registration time and the
    file they were registered from."""
    entries = runner.catalog_entries(noetl_settings.load().database_url)
    if as_json:
        shown = [
            {**e, "registered_at": e["registered_at"].isoformat() if e["registered_at"] else None} for e in entries
        ]
        echo(json.dumps({"entries": shown}, default=str))
        return
    if not entries:
        echo("no playbooks registered (noetl-celery register FILE...)")
        return
    for e in entries:
        when = e["registered_at"].strftime("%Y-%m-%d %H:%M:%S") if e["registered_at"] else "-"
        echo(f"{e['path']:<40} {e['name']:<28} {when}  {e['source_file'] or ''}")


# --- schedules (noetl_celery/schedules/__init__.py; `celery -A noetl_celery beat` fires them) -------


@cli.group(name="schedule")
def schedule_group() -> None:
    """Playbooks started by `celery -A noetl_celery beat` on a cron expression or an interval."""


def _schedule_call(fn: Any) -> Any:
    from noetl_celery.schedules import ScheduleError, ScheduleNotFound

    try:
        return fn()
    except (ScheduleError, ScheduleNotFound) as exc:
        echo(f"error: {exc}", err=True)
        sys.exit(EXIT_INVALID)


def _schedule_line(item: dict[str, Any]) -> str:
    when = f"cron {item['cron']!r} {item['timezone']}" if item["cron"] else f"every {item['every']} s"
    state = "paused" if item["paused"] else f"next {item['next_fire']}"
    return f"{item['name']:<24} {item['playbook']:<32} {when:<28} {state}  (last {item['last_fire'] or '-'})"


@schedule_group.command(name="add")
@click.argument("name")
@click.argument("playbook")
@click.option("--cron", default=None, help="A cron expression: 5 fields, or 6 with seconds first.")
@click.option("--every", type=int, default=None, help="An interval in whole seconds (instead of --cron).")
@click.option("--timezone", "--tz", "timezone", default="UTC", show_default=True, help="The cron's time zone (IANA).")
@click.option("--set", "sets", multiple=True, metavar="KEY=VALUE", help="Override a workload value.")
@click.option(
    "--missed",
    type=click.Choice(["latest", "skip"]),
    default="latest",
    show_default=True,
    help="Fire times missed while no beat ran: run the latest once, or skip them.",
)
@click.option("--paused", is_flag=True, help="Store it paused (`schedule resume` starts it).")
@click.option("--replace", is_flag=True, help="Overwrite a schedule of the same name.")
@click.option("--json", "as_json", is_flag=True)
def schedule_add(
    name: str,
    playbook: str,
    cron: str | None,
    every: int | None,
    timezone: str,
    sets: tuple[str, ...],
    missed: str,
    paused: bool,
    replace: bool,
    as_json: bool,
) -> None:
    """Schedule PLAYBOOK (a catalog path, or a playbook file) under NAME."""
    from noetl_celery import schedules

    url = noetl_settings.load().database_url
    overrides = _parse_sets(sets)

    def add() -> dict[str, Any]:
        values = schedules.validate(
            name, playbook, cron=cron, every=every, timezone=timezone, workload=overrides, missed=missed, paused=paused
        )
        return schedules.add(url, values, replace=replace)

    item = _schedule_call(add)
    if as_json:
        _print_json(item)
    else:
        echo(f"schedule {item['name']}: {_schedule_line(item)}")


@schedule_group.command(name="list")
@click.option("--json", "as_json", is_flag=True)
def schedule_list(as_json: bool) -> None:
    """The schedules, with their last and next fire times."""
    from noetl_celery import schedules

    items = schedules.list_all(noetl_settings.load().database_url)
    if as_json:
        _print_json(items)
        return
    if not items:
        echo("no schedules")
    for item in items:
        echo(_schedule_line(item))


@schedule_group.command(name="show")
@click.argument("name")
@click.option("--runs", type=click.IntRange(min=1), default=20, show_default=True)
def schedule_show(name: str, runs: int) -> None:
    """A schedule and its latest fire times (JSON): which execution each started."""
    from noetl_celery import schedules

    url = noetl_settings.load().database_url
    _print_json(_schedule_call(lambda: schedules.get(url, name, runs)))


@schedule_group.command(name="remove")
@click.argument("name")
def schedule_remove(name: str) -> None:
    """Remove a schedule (the record of what it started stays)."""
    from noetl_celery import schedules

    url = noetl_settings.load().database_url
    _schedule_call(lambda: schedules.remove(url, name))
    echo(f"schedule {name}: removed")


@schedule_group.command(name="pause")
@click.argument("name")
def schedule_pause(name: str) -> None:
    """Pause a schedule: no fire time starts until `schedule resume`."""
    from noetl_celery import schedules

    url = noetl_settings.load().database_url
    _schedule_call(lambda: schedules.set_paused(url, name, True))
    echo(f"schedule {name}: paused")


@schedule_group.command(name="resume")
@click.argument("name")
def schedule_resume(name: str) -> None:
    """Resume a paused schedule from now on (the fire times while it was paused do not run)."""
    from noetl_celery import schedules

    url = noetl_settings.load().database_url
    item = _schedule_call(lambda: schedules.set_paused(url, name, False))
    echo(f"schedule {name}: resumed, next {item['next_fire']}")


def main() -> None:
    secret_registry.install_log_filter()
    _log_format(log_format.CLI_LEVEL)
    try:
        cli(prog_name="noetl-celery")
    except ConfigurationError as exc:
        echo(f"error: {exc}", err=True)
        sys.exit(EXIT_INVALID)
    except Exception as exc:
        line = _infrastructure_error(exc)
        if line is None or _options["debug"]:
            if line is not None:
                echo(f"error: {line}", err=True)
            raise
        echo(f"error: {line}", err=True)
        sys.exit(EXIT_INVALID)


def _infrastructure_error(exc: BaseException) -> str | None:
    """One line for a failure to use the store or the broker (None for any other exception)."""
    url_as_set, broker_url = noetl_settings.urls_as_set()
    database_url: str | None
    try:
        database_url = noetl_settings.load().database_url
    except ConfigurationError:  # another setting is refused: describe the store by its URL as set
        database_url = url_as_set
    return describe_infrastructure_error(exc, database_url, broker_url)


if __name__ == "__main__":
    main()


__all__ = ["cli", "main", "Path"]
