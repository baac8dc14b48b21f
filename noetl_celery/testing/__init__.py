"""Test your playbooks: run one to its end in this process, tools mocked where you say, time skipped.

    from noetl_celery.testing import fails, run_playbook, sequence

    def test_fetch_is_retried_then_loaded():
        run = run_playbook(
            "playbooks/etl.yaml",
            set={"city": "Paris"},
            mocks={"fetch": sequence(fails("http", "503", retryable=True), {"temp": 21})},
        )
        assert run.status == "completed"
        assert run.results["load"]["rows"] == 1
        assert run.calls["fetch"][0]["params"] == {"q": "Paris"}

The playbook is compiled as `noetl-celery run` compiles it (the same validation: a broken playbook
raises `PlaybookError` with every problem); its dispatches run through the same code as the Celery
tasks, on a SQLite event store of its own (or the store you name), with no broker and no worker:
a retry's backoff or a dispatch's countdown is skipped, not waited for. `mocks` (see
`noetl_celery.testing.mocks`) replace the calls of the steps (or tool kinds) they name; other
steps run their real tools. The result holds the execution's outcome, each step's result, the
event rows (as `noetl-celery events --json` reads them) and the mocked calls.

With pytest, the `noetl_playbook` fixture (the plugin this package registers) is `run_playbook`
with its store in the test's temporary directory.
"""

from __future__ import annotations

import json
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from noetl_celery.core.errors import Problem
from noetl_celery.testing.mocks import Failure, Sequence, ToolMocks, fails, sequence

__all__ = ["Failure", "RunResult", "Sequence", "fails", "run_playbook", "sequence"]


@dataclass
class RunResult:
    """One run of a playbook on the harness.

    status: completed, failed or cancelled; outcome: the whole status document (`noetl-celery
    run --json`); results: each step's result by step name; error: the execution's error (None
    when it completed); events: the event rows in order; calls: the mocked calls' rendered
    configs by step; warnings: what validation warned about; exit_code: what `run` would exit with.
    """

    execution_id: int
    status: str
    outcome: dict[str, Any]
    events: list[dict[str, Any]]
    calls: dict[str, list[dict[str, Any]]]
    warnings: list[Problem] = field(default_factory=list)

    @property
    def results(self) -> dict[str, Any]:
        return self.outcome.get("results", {})

    @property
    def error(self) -> Any:
        return self.outcome.get("error")

    @property
    def exit_code(self) -> int:
        from noetl_celery.testing.harness import exit_code

        return exit_code(self.outcome)

    def event_types(self) -> list[str]:
        """The event rows' types in order (e.g. to assert that a step was retried)."""
        return [str(row.get("event_type")) for row in self.events]


def run_playbook(
    playbook: str | Path,
    *,
    set: Mapping[str, Any] | None = None,  # noqa: A002  # the command line's `--set`
    mocks: Mapping[str, Any] | None = None,
    env: Mapping[str, str] | None = None,
    database_url: str | None = None,
) -> RunResult:
    """Run `playbook` (a file) to its end in this process and return what happened.

    set: workload overrides, as `--set key=value` (dotted keys reach inside); mocks: by step name
    or `kind:<tool kind>` (see noetl_celery.testing.mocks); env: environment variables for the run
    (credentials `NOETL_AUTH_*`), restored afterwards; database_url: the event store (default: a
    new SQLite file in a temporary directory)."""
    from noetl_celery import runner
    from noetl_celery.compiler import compile_source
    from noetl_celery.config import secret_registry
    from noetl_celery.store.db import transaction
    from noetl_celery.store.events import list_events
    from noetl_celery.testing.harness import Harness, cli_sets, environment

    url = database_url or f"sqlite:///{Path(tempfile.mkdtemp(prefix='noetl-test-')) / 'noetl.sqlite'}"
    tool_mocks = ToolMocks(by_key=dict(mocks or {}))
    warnings: list[Problem] = []
    with environment(env or {}):
        plan = compile_source(str(playbook), cli_sets(set or {}), runner.catalog(url), warnings=warnings)
        harness = Harness(url, mocks=tool_mocks)
        execution_id = harness.start(plan)
        harness.drain()
        status = runner.execution_status(url, execution_id)
        masked = json.loads(secret_registry.mask_text(json.dumps(status, default=str)))
    with transaction(url) as conn:
        events = list_events(conn, execution_id)
    events = json.loads(secret_registry.mask_text(json.dumps(events, default=str)))
    return RunResult(execution_id, str(masked["status"]), masked, events, dict(tool_mocks.calls), warnings)
