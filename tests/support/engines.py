"""Run playbooks in-process (tests.support.harness) or through the real command line, in the two
deployments a user has:

- InProcessEngine: the harness on a SQLite store, with time skipped (the fast tier's DSL semantics);

- EmbeddedEngine: `noetl-celery run --json` (SQLite under NOETL_HOME, in-process worker,
  in-memory broker), in a subprocess with no broker or database configured;
- DistributedEngine: `noetl-celery submit --wait --json` on Redis + PostgreSQL, executed by
  separate `celery -A noetl_celery worker` processes.

Both read the event log back through the store, the way `noetl-celery events` does.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from noetl_celery.store import repo
from noetl_celery.store.db import transaction

REPO_ROOT = Path(__file__).resolve().parents[2]
RUN_TIMEOUT = 180  # seconds one playbook may take in a test


@dataclass
class RunResult:
    returncode: int
    status: dict[str, Any]
    stderr: str

    @property
    def execution_id(self) -> int:
        return int(self.status["execution_id"])

    @property
    def results(self) -> dict[str, Any]:
        return self.status.get("results", {})


def _clean_env(extra: Mapping[str, str]) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("NOETL_") or k.startswith("NOETL_TEST_")}
    env.update(extra)
    return env


def cli(args: Sequence[str], env: Mapping[str, str], timeout: float = RUN_TIMEOUT) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "noetl_celery.cli", *args],
        env=_clean_env(env),
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=REPO_ROOT,
    )


def _sets(values: Mapping[str, Any]) -> list[str]:
    out = []
    for key, value in values.items():
        out += ["--set", f"{key}={json.dumps(value) if not isinstance(value, str) else value}"]
    return out


def submit(env: Mapping[str, str], playbook: str | Path, **sets: Any) -> int:
    """`noetl-celery submit --json PLAYBOOK --set k=v ...` for separate workers; the execution id."""
    proc = cli(["submit", str(playbook), "--json", *_sets(sets)], env)
    assert proc.returncode == 0, proc.stderr
    return int(json.loads(proc.stdout)["execution_id"])


class Engine:
    mode = ""
    database_url = ""
    env: dict[str, str]

    def command(self) -> list[str]:
        raise NotImplementedError

    def run(
        self, playbook: str | Path, sets: Mapping[str, Any] | None = None, timeout: float = RUN_TIMEOUT
    ) -> RunResult:
        proc = cli([*self.command(), str(playbook), "--json", *_sets(sets or {})], self.env, timeout)
        try:
            status = json.loads(proc.stdout) if proc.stdout.strip() else {}
        except json.JSONDecodeError:
            raise AssertionError(f"not JSON on stdout:\n{proc.stdout}\nstderr:\n{proc.stderr}") from None
        return RunResult(proc.returncode, status, proc.stderr)

    def events(self, execution_id: int) -> list[dict[str, Any]]:
        with transaction(self.database_url) as conn:
            return repo.list_events(conn, execution_id)

    def status(self, execution_id: int) -> dict[str, Any]:
        """What `noetl-celery status ID --json` prints."""
        proc = cli(["status", str(execution_id), "--json"], self.env)
        return json.loads(proc.stdout)


class EmbeddedEngine(Engine):
    mode = "embedded"

    def __init__(self, home: Path, env: Mapping[str, str] | None = None):
        self.env = {"NOETL_HOME": str(home), **(env or {})}
        self.database_url = f"sqlite:///{home / 'noetl.sqlite'}"

    def command(self) -> list[str]:
        return ["run", "--timeout", str(RUN_TIMEOUT)]


class InProcessEngine(Engine):
    mode = "inprocess"

    def __init__(self, home: Path, env: Mapping[str, str] | None = None):
        self.env = {"NOETL_HOME": str(home), **(env or {})}
        self.database_url = f"sqlite:///{home / 'noetl.sqlite'}"

    def run(
        self, playbook: str | Path, sets: Mapping[str, Any] | None = None, timeout: float = RUN_TIMEOUT
    ) -> RunResult:
        from tests.support.harness import run_playbook

        returncode, status = run_playbook(self.database_url, playbook, sets, self.env)
        return RunResult(returncode, status, "")

    def status(self, execution_id: int) -> dict[str, Any]:
        """The `status ID --json` command run in this process (click's test runner)."""
        from click.testing import CliRunner

        from noetl_celery.cli import cli as command

        result = CliRunner().invoke(command, ["status", str(execution_id), "--json"], env=self.env)
        return json.loads(result.stdout)


class DistributedEngine(Engine):
    mode = "distributed"

    def __init__(self, broker_url: str, database_url: str, env: Mapping[str, str] | None = None):
        self.env = {"NOETL_BROKER_URL": broker_url, "NOETL_DATABASE_URL": database_url, **(env or {})}
        self.database_url = database_url

    def command(self) -> list[str]:
        return ["submit", "--wait", "--timeout", str(RUN_TIMEOUT)]


def event_types(events: list[dict[str, Any]], step: str | None = None) -> list[str]:
    return [e["event_type"] for e in events if step is None or e["step"] == step]


def step_order(events: list[dict[str, Any]], event_type: str = "step.started") -> list[str]:
    return [e["step"] for e in events if e["event_type"] == event_type]
