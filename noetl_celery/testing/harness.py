"""The in-process harness: an execution's dispatches run in this process, on SQLite or PostgreSQL,
with time skipped, through the same seam as the Celery tasks (`worker.execute` or
`worker.execute_batch` for a task message, then `orchestrator.handle_event` for its outcome).
`noetl_celery.testing.run_playbook` is the way in for a playbook's own tests; this module is the
machinery under it (and under the project's own tests).

It plays the part of dramatiq's StubBroker and Temporal's time-skipping test server: no broker,
no worker process, no wait. A dispatch with a countdown is due that many seconds after the
decision that made it on the harness's clock, which jumps to the next due dispatch instead of
sleeping: a retry's 1 s + 2 s backoffs cost nothing. Dispatches run one at a time in order of due
time (then of decision), so a loop's iterations run one after another: concurrency, delivery and
recovery are proved by the tests with real workers (tests/distributed), not here.
"""

from __future__ import annotations

import heapq
import itertools
import json
import os
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from noetl_celery import runner
from noetl_celery.compiler import compile_source
from noetl_celery.config import secret_registry
from noetl_celery.dsl.plan import Plan
from noetl_celery.dsl.set_values import parse_assignments
from noetl_celery.engine.attempt import worker
from noetl_celery.engine.decision import orchestrator
from noetl_celery.engine.messages import Dispatch, TaskMessage
from noetl_celery.testing.mocks import ToolMocks

NODE = "harness@localhost"  # the worker name recorded on the harness's attempts
MAX_DISPATCHES = 200_000  # a run that decides more than this is taken for a runaway


class Runaway(AssertionError):
    """The execution kept deciding past MAX_DISPATCHES."""


@dataclass
class Harness:
    """Runs executions on the store at `database_url`. `clock`: the harness's time in seconds,
    advanced to each dispatch's due time; `ran`: the dispatches run, in order."""

    database_url: str
    clock: float = 0.0
    ran: list[Dispatch] = field(default_factory=list)
    mocks: ToolMocks = field(default_factory=ToolMocks)
    _queue: list[tuple[float, int, Dispatch]] = field(default_factory=list)
    _order: Iterator[int] = field(default_factory=itertools.count)

    def start(self, plan: Plan) -> int:
        """Create an execution of `plan` and decide its start; returns its id."""
        execution_id = runner.create_execution(plan, self.database_url)
        self.send(orchestrator.handle_event(self.database_url, orchestrator.start_payload(execution_id)))
        return execution_id

    def send(self, dispatches: list[Dispatch]) -> None:
        """Queue decided dispatches, each due after its countdown."""
        for dispatch in dispatches:
            heapq.heappush(self._queue, (self.clock + max(dispatch.countdown, 0.0), next(self._order), dispatch))

    def step(self) -> bool:
        """Run the next due dispatch and queue what its decision dispatches; False when none is left."""
        if not self._queue:
            return False
        due, order, dispatch = heapq.heappop(self._queue)
        self.clock = max(self.clock, due)
        self.ran.append(dispatch)
        payload = self.outcome_of(dispatch, f"harness-{order}")
        if payload is not None:
            self.send(orchestrator.handle_event(self.database_url, payload))
        return True

    def outcome_of(self, dispatch: Dispatch, queue_id: str) -> dict[str, Any] | None:
        """The on_event payload a dispatch leads to: an event is its own; a task message is run."""
        if dispatch.kind == "event":
            return dispatch.message
        message = TaskMessage.from_dict(dispatch.message)
        run = worker.execute_batch if message.batch else worker.execute
        with self.mocks.stepping(message.step):
            return run(self.database_url, message, queue_id=queue_id, node=NODE)

    def drain(self) -> int:
        """Run dispatches until none is left; returns how many ran."""
        count = 0
        while self.step():
            count += 1
            if count > MAX_DISPATCHES:
                raise Runaway(f"more than {MAX_DISPATCHES} dispatches: a runaway execution")
        return count

    def run(self, plan: Plan) -> dict[str, Any]:
        """Start an execution of `plan`, run it to its end, and return its status
        (`runner.execution_status`, as `noetl-celery run --json` prints it)."""
        execution_id = self.start(plan)
        self.drain()
        return runner.execution_status(self.database_url, execution_id)


@contextmanager
def environment(values: Mapping[str, str]) -> Iterator[None]:
    """`values` in os.environ for the duration (credentials are read from it where they are used)."""
    saved = {key: os.environ.get(key) for key in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        # the python tool moves credential variables out of os.environ (secret_registry's sealed
        # copy, still read by credentials): drop the copy of each one set here, so that it does
        # not outlive the block in this process
        with secret_registry._lock:
            for key in values:
                if key not in os.environ:
                    secret_registry._sealed.pop(key, None)
            secret_registry._cache["key"] = None


def cli_sets(values: Mapping[str, Any]) -> dict[str, Any]:
    """Workload overrides read as `--set key=value` reads them (a dotted key reaches into the
    workload; a string value is read as YAML, anything else as its JSON)."""
    return parse_assignments(
        tuple(f"{key}={value if isinstance(value, str) else json.dumps(value)}" for key, value in values.items())
    )


def exit_code(status: Mapping[str, Any]) -> int:
    """The exit code `noetl-celery run` gives an execution of this status."""
    from noetl_celery.cli import _exit_for  # the command line only when an exit code is asked for

    return _exit_for(dict(status))


def run_playbook(
    database_url: str, playbook: str | Path, sets: Mapping[str, Any] | None = None, env: Mapping[str, str] | None = None
) -> tuple[int, dict[str, Any]]:
    """Compile and run a playbook file to its end in-process, as `noetl-celery run --json` would:
    returns its exit code and its status, secrets masked as the command prints them."""
    with environment(env or {}):
        plan = compile_source(str(playbook), cli_sets(sets or {}), runner.catalog(database_url))
        status = Harness(database_url).run(plan)
        masked = json.loads(secret_registry.mask_text(json.dumps(status, default=str)))
    return exit_code(masked), masked
