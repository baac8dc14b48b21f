"""Following executions from the command line, on Redis + PostgreSQL with real workers:
`submit --wait` (id at once, progress, Ctrl-C detaches), `status`, `executions`, `events --follow`."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

from noetl_celery.runner import wait
from noetl_celery.store import repo
from noetl_celery.store.db import transaction
from tests.distributed.test_retry_delivery import submit
from tests.support.engines import REPO_ROOT, _clean_env, cli

PLAYBOOKS = Path(__file__).resolve().parents[1] / "playbooks"


def _default_sigint() -> None:
    """Ctrl-C as a terminal delivers it, whatever the test runner inherited: a process started in
    the background of a shell without job control ignores SIGINT, and so would the command."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _spawn(args: list[str], env: dict[str, str]) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "noetl_celery.cli", *args],
        env=_clean_env(env),
        cwd=REPO_ROOT,
        preexec_fn=_default_sigint,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _wait_for_iterations(url: str, execution_id: int, count: int, timeout: float = 60) -> None:
    """Until `count` iterations of the execution completed."""
    deadline = time.monotonic() + timeout
    while True:
        with transaction(url) as conn:
            done = [e for e in repo.list_events(conn, execution_id) if e["event_type"] == "iteration.completed"]
        if len(done) >= count:
            return
        assert time.monotonic() < deadline, f"fewer than {count} iterations after {timeout} s"
        time.sleep(0.1)


def test_submit_wait_prints_the_id_at_once_and_ctrl_c_detaches(env, store_url, worker_factory):
    worker_factory(env=env, concurrency=2)
    proc = _spawn(
        [
            "submit",
            str(PLAYBOOKS / "loop_many.yaml"),
            "--wait",
            "--set",
            "n=40",
            "--set",
            "sleep=0.5",
            "--set",
            "cap=2",
        ],
        env,
    )
    assert proc.stderr is not None
    first = proc.stderr.readline()  # before the run ends: the id comes first
    assert first.startswith("submitted execution "), first
    execution_id = int(first.split()[2].rstrip(";"))
    assert proc.poll() is None
    _wait_for_iterations(store_url, execution_id, 2)  # 10 s of loop: Ctrl-C comes in its middle
    status = cli(["status", str(execution_id)], env)
    assert status.returncode == 3, status.stdout  # still running
    assert "loop work: running " in status.stdout and "in flight" in status.stdout, status.stdout
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 5, (out, err)
    assert "detached" in err and f"noetl-celery events {execution_id} --follow" in err
    assert f"noetl-celery cancel {execution_id}" in err and "Aborted" not in err
    assert wait(store_url, execution_id, timeout=180)["status"] == "completed"  # the run went on


def test_submit_wait_writes_plain_progress_lines_off_a_terminal(env, store_url, worker_factory):
    worker_factory(env=env, concurrency=2)
    proc = cli(["submit", str(PLAYBOOKS / "flower_truth.yaml"), "--wait"], env)
    assert proc.returncode == 1, proc.stderr
    lines = proc.stderr.splitlines()
    assert lines[0].startswith("submitted execution ")
    assert any(line.startswith("loop      work: 3 iterations") for line in lines), lines
    assert any(
        line.startswith("retry     work iteration 1: attempt 2") and "flaky record 17" in line for line in lines
    ), lines
    assert any(line.startswith("failed    explode: ValueError: bad record 99") for line in lines), lines
    assert "\x1b[" not in proc.stderr  # no terminal control codes off a terminal
    quiet = cli(["submit", str(PLAYBOOKS / "flower_truth.yaml"), "--wait", "--quiet"], env)
    assert quiet.returncode == 1 and len(quiet.stderr.splitlines()) == 1, quiet.stderr
    as_json = cli(["submit", str(PLAYBOOKS / "flower_truth.yaml"), "--wait", "--json"], env)
    assert set(json.loads(as_json.stdout)) >= {"execution_id", "status", "error", "results"}


def test_status_of_a_failed_loop_names_the_iteration_its_error_and_input(env, store_url, worker_factory):
    worker_factory(env=env, concurrency=2)
    execution_id = submit(env, PLAYBOOKS / "loop_failures.yaml")
    assert wait(store_url, execution_id, timeout=120)["status"] == "failed"
    status = cli(["status", str(execution_id)], env)
    assert status.returncode == 1
    assert "failing attempt: step strict iteration 2 attempt 1" in status.stdout, status.stdout
    assert "error: ZeroDivisionError: integer division or modulo by zero" in status.stdout
    assert "element: 0" in status.stdout and 'input: {"args": {"d": 0}}' in status.stdout  # rendered args
    as_json = json.loads(cli(["status", str(execution_id), "--json"], env).stdout)
    assert as_json["failure"]["iteration"] == 2 and as_json["failure"]["input"] == {"args": {"d": 0}}
    assert as_json["failure"]["element"] == 0
    assert as_json["loops"][0]["done"] == 4 and as_json["status"] == "failed"


def test_executions_filters_and_events_follow(env, store_url, worker_factory):
    worker_factory(env=env, concurrency=2)
    execution_id = submit(env, PLAYBOOKS / "loop_many.yaml", n=20, sleep=0.1)
    follow = cli(["events", str(execution_id), "--follow"], env)  # returns once the run has ended
    assert follow.returncode == 0
    lines = follow.stdout.splitlines()
    assert sum(" iteration.completed " in line for line in lines) == 20
    assert " execution.completed " in lines[-1], lines[-3:]
    rows = json.loads(
        cli(["executions", "--json", "--status", "completed", "--playbook", "loop_many", "--limit", "200"], env).stdout
    )
    mine = [r for r in rows if r["execution_id"] == execution_id]
    assert mine and mine[0]["duration_s"] > 0 and (mine[0]["done"], mine[0]["total"]) == (22, 22), mine
    assert all(r["status"] == "completed" and r["playbook"] == "loop_many" for r in rows)
    failed = json.loads(cli(["executions", "--json", "--status", "failed", "--playbook", "loop_many"], env).stdout)
    assert execution_id not in [r["execution_id"] for r in failed]
