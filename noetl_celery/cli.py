"""The management command `noetl-celery`: parses arguments, calls runner/compiler, prints.

Exit codes: 0 completed (or valid), 1 the execution failed, 2 the playbook or the arguments are
invalid, 3 still running when --timeout ran out.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import click
import yaml

from noetl_celery import runner
from noetl_celery import settings as noetl_settings
from noetl_celery.compiler import compile_playbook, describe
from noetl_celery.dsl.plan import Plan
from noetl_celery.errors import ConfigurationError, ExecutionNotFound, PlaybookError

EXIT_OK, EXIT_FAILED, EXIT_INVALID, EXIT_RUNNING = 0, 1, 2, 3
SUMMARY_WIDTH = 70  # characters of a result/error shown per event row in the table


def _parse_sets(values: tuple[str, ...]) -> dict[str, Any]:
    """`--set a.b=1` -> {"a": {"b": 1}}; values are read as YAML scalars (numbers, booleans, lists)."""
    overrides: dict[str, Any] = {}
    for item in values:
        key, sep, raw = item.partition("=")
        if not sep or not key:
            raise click.BadParameter(f"expected key=value, got {item!r}", param_hint="--set")
        try:
            value = yaml.safe_load(raw) if raw else ""
        except yaml.YAMLError:
            value = raw
        if isinstance(value, int) and raw.strip().lstrip("+-").startswith("0") and len(raw.strip()) > 1:
            value = raw  # "01234" is a code with a leading zero, not YAML 1.1's octal
        target = overrides
        *parents, leaf = key.split(".")
        for part in parents:
            target = target.setdefault(part, {})
        target[leaf] = value
    return overrides


def _compile(path: str, sets: tuple[str, ...] = ()) -> Plan:
    try:
        return compile_playbook(path, overrides=_parse_sets(sets))
    except PlaybookError as exc:
        for problem in exc.problems:
            click.echo(str(problem), err=True)
        sys.exit(EXIT_INVALID)
    except OSError as exc:
        click.echo(f"{path}: {exc.strerror or exc}", err=True)
        sys.exit(EXIT_INVALID)


def _print_json(value: Any) -> None:
    click.echo(json.dumps(value, indent=2, default=str))


def _exit_for(status: dict[str, Any]) -> int:
    return {"completed": EXIT_OK, "failed": EXIT_FAILED}.get(status["status"], EXIT_RUNNING)


def _print_outcome(status: dict[str, Any], as_json: bool) -> None:
    if as_json:
        _print_json(status)
        return
    click.echo(f"execution {status['execution_id']} ({status['playbook']}): {status['status']}")
    if status.get("error"):
        click.echo(f"  failed step: {status.get('failed_step')}")
        click.echo(f"  error: {json.dumps(status['error'], default=str)[:500]}")
    for step, result in status.get("results", {}).items():
        click.echo(f"  {step}: {_summary(result)}")


def _summary(value: Any) -> str:
    text = json.dumps(value, default=str) if value is not None else ""
    return text if len(text) <= SUMMARY_WIDTH else text[: SUMMARY_WIDTH - 3] + "..."


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="noetl_celery")
def cli() -> None:
    """Run NoETL playbooks on Celery. Embedded default: SQLite under NOETL_HOME (~/.noetl) and an
    in-process worker; set NOETL_BROKER_URL and NOETL_DATABASE_URL for real workers."""


@cli.command()
@click.argument("playbook", type=click.Path(dir_okay=False))
def validate(playbook: str) -> None:
    """Check a playbook; prints `file:line: path: message` per problem (exit 2)."""
    plan = _compile(playbook)
    click.echo(f"{playbook}: valid {plan.dialect} playbook '{plan.name}' with {len(plan.steps)} steps")


@cli.command(name="compile")
@click.argument("playbook", type=click.Path(dir_okay=False))
@click.option("--json", "as_json", is_flag=True, help="Print the plan as JSON.")
@click.option("--set", "sets", multiple=True, metavar="KEY=VALUE", help="Override a workload value.")
def compile_cmd(playbook: str, as_json: bool, sets: tuple[str, ...]) -> None:
    """Show the plan: steps, task signatures, policies and routing."""
    plan = _compile(playbook, sets)
    settings = noetl_settings.load()
    described = describe(plan, task_queue=settings.task_queue, event_queue=settings.event_queue)
    if as_json:
        _print_json({**described, "plan": plan.model_dump(mode="json")})
        return
    click.echo(f"{described['playbook']} ({described['dialect']}, {described['api_version']}), "
               f"entry: {described['entry_step']}")
    for step in described["steps"]:
        click.echo(f"- step {step['step']}" + (f"  [loop {step['loop']}]" if step["loop"] else ""))
        tasks = step["tasks"]
        if isinstance(tasks, str):
            click.echo(f"    {tasks}")
        else:
            for task in tasks:
                sig = task["signature"]
                click.echo(f"    task {task['label']} ({task['kind']}): {sig['task']} queue={sig['queue']} "
                           f"shadow={sig['shadow']}" + (f" sink={task['sink']}" if task["sink"] else ""))
                for line in task["policy"]:
                    click.echo(f"      policy: {line}")
        for arc in step["next"]["arcs"]:
            cond = f" when {'not ' if arc['negate'] else ''}{arc['when']}" if arc["when"] is not None else ""
            click.echo(f"    next ({step['next']['mode']}) -> {arc['step']}{cond}")
        if step["join"]:
            click.echo(f"    branches join at {step['join']}")


@cli.command()
@click.argument("playbook", type=click.Path(dir_okay=False))
@click.option("--set", "sets", multiple=True, metavar="KEY=VALUE", help="Override a workload value.")
@click.option("--json", "as_json", is_flag=True, help="Print the outcome as one JSON object.")
@click.option("--timeout", type=float, default=None, help="Give up waiting after this many seconds.")
def run(playbook: str, sets: tuple[str, ...], as_json: bool, timeout: float | None) -> None:
    """Run a playbook to completion with an in-process worker (embedded default)."""
    plan = _compile(playbook, sets)
    status = runner.run_embedded(plan, timeout=timeout)
    _print_outcome(status, as_json)
    sys.exit(_exit_for(status))


@cli.command()
@click.argument("playbook", type=click.Path(dir_okay=False))
@click.option("--set", "sets", multiple=True, metavar="KEY=VALUE", help="Override a workload value.")
@click.option("--wait", is_flag=True, help="Follow the execution to its end.")
@click.option("--json", "as_json", is_flag=True, help="Print the outcome as one JSON object.")
@click.option("--timeout", type=float, default=None, help="With --wait: give up after this many seconds.")
def submit(playbook: str, sets: tuple[str, ...], wait: bool, as_json: bool, timeout: float | None) -> None:
    """Enqueue a playbook on the configured broker for `celery -A noetl_celery worker` processes."""
    plan = _compile(playbook, sets)
    settings = noetl_settings.load()
    try:
        noetl_settings.require_broker(settings)
    except ConfigurationError as exc:
        click.echo(f"error: {exc}", err=True)
        sys.exit(EXIT_INVALID)
    execution_id = runner.submit(plan, settings)
    if not wait:
        if as_json:
            _print_json({"execution_id": execution_id, "status": "running", "error": None, "results": {}})
        else:
            click.echo(f"submitted execution {execution_id}")
        return
    status = runner.wait(settings.database_url, execution_id, timeout)
    _print_outcome(status, as_json)
    sys.exit(_exit_for(status))


def _execution_or_exit(fn: Any, execution_id: int) -> Any:
    try:
        return fn(noetl_settings.load().database_url, execution_id)
    except ExecutionNotFound as exc:
        click.echo(f"error: {exc}", err=True)
        sys.exit(EXIT_INVALID)


@cli.command()
@click.argument("execution_id", type=int)
@click.option("--json", "as_json", is_flag=True)
def status(execution_id: int, as_json: bool) -> None:
    """The state of an execution, read from the event store."""
    result = _execution_or_exit(runner.execution_status, execution_id)
    _print_outcome(result, as_json)
    sys.exit(_exit_for(result))


@cli.command()
@click.argument("execution_id", type=int)
@click.option("--json", "as_json", is_flag=True, help="Print the event rows as a JSON list.")
def events(execution_id: int, as_json: bool) -> None:
    """The event log of an execution, in order."""
    rows = _execution_or_exit(runner.execution_events, execution_id)
    if as_json:
        _print_json(rows)
        return
    header = f"{'#':>5} {'time':12} {'event':20} {'step':22} {'task':16} {'it':>4} {'att':>3} {'ms':>8}  detail"
    click.echo(header)
    for row in rows:
        detail = row["error"] or row["result"] or row["meta"]
        click.echo(
            f"{row['id']:>5} {row['created_at'].strftime('%H:%M:%S.%f')[:12]:12} {row['event_type']:20} "
            f"{(row['step'] or '')[:22]:22} {(row['task'] or '')[:16]:16} "
            f"{'' if row['iteration'] is None else row['iteration']:>4} {row['attempt'] or '':>3} "
            f"{'' if row['duration_ms'] is None else round(row['duration_ms'], 1):>8}  {_summary(detail)}"
        )


@cli.command()
@click.option("--revision", default="head", show_default=True)
def migrate(revision: str) -> None:
    """Create or upgrade the event store schema (alembic upgrade) on NOETL_DATABASE_URL."""
    from noetl_celery.store.db import migrate as run_migrations

    settings = noetl_settings.load()
    run_migrations(settings.database_url, revision)
    click.echo(f"event store at {runner._safe_url(settings.database_url)} is at revision {revision}")


@cli.command(name="executions")
@click.option("--limit", default=20, show_default=True)
def executions_cmd(limit: int) -> None:
    """The most recent executions."""
    from noetl_celery.store import repo
    from noetl_celery.store.db import ensure_schema, transaction

    url = noetl_settings.load().database_url
    ensure_schema(url)
    with transaction(url) as conn:
        for row in repo.list_executions(conn, limit):
            click.echo(f"{row['execution_id']}  {row['status']:10} {row['playbook_name']:30} {row['created_at']}")


def main() -> None:
    try:
        cli(prog_name="noetl-celery")
    except ConfigurationError as exc:
        click.echo(f"error: {exc}", err=True)
        sys.exit(EXIT_INVALID)


if __name__ == "__main__":
    main()


__all__ = ["cli", "main", "Path"]
