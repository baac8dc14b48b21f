"""The shell tool on real worker processes (Redis + PostgreSQL): nothing a shell step started
outlives its attempt, whether it timed out, its execution was cancelled, or its worker was killed
with SIGKILL in the middle of it; and the step run again after the kill does not repeat what the
killed attempt did (the step appends under an idempotence key)."""

from __future__ import annotations

import time
from pathlib import Path

from noetl_celery.runner import wait
from tests.distributed.test_durability import rows
from tests.support.engines import cli, submit
from tests.support.workers import group_members, process_alive

PLAYBOOKS = Path(__file__).resolve().parents[1] / "playbooks"


def wait_for_lines(path: Path, count: int, timeout: float = 60) -> list[str]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if path.exists():
            lines = path.read_text().split()
            if len(lines) >= count:
                return lines
        time.sleep(0.05)
    raise AssertionError(f"{path} never had {count} line(s)")


def wait_gone(pgid: int, timeout: float = 10) -> list[int]:
    deadline = time.monotonic() + timeout
    while group_members(pgid) and time.monotonic() < deadline:
        time.sleep(0.1)
    return group_members(pgid)


def test_a_timed_out_shell_step_leaves_no_process(env, store_url, worker_factory, tmp_path):
    worker_factory(env=env, concurrency=1, name="shell-timeout@%h")
    pidfile = tmp_path / "pid"
    execution_id = submit(env, PLAYBOOKS / "shell_sleeps.yaml", pidfile=str(pidfile), seconds=2)
    pgid, child = wait_for_lines(pidfile, 2)  # written once its background child was started
    status = wait(store_url, execution_id, timeout=60)
    assert status["status"] == "failed" and status["error"]["kind"] == "timeout", status
    assert wait_gone(int(pgid)) == []
    assert not process_alive(int(child))


def test_a_cancelled_execution_stops_its_running_shell_step(env, store_url, worker_factory, tmp_path):
    worker_factory(env=env, concurrency=1, name="shell-cancel@%h")
    pidfile = tmp_path / "pid"
    execution_id = submit(env, PLAYBOOKS / "shell_sleeps.yaml", pidfile=str(pidfile), seconds=120)
    pgid, child = wait_for_lines(pidfile, 2)
    assert len(group_members(int(pgid))) >= 2  # the program and its background child (it may run 120 s)
    proc = cli(["cancel", str(execution_id), "--reason", "operator stop"], env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    cancelled_at = time.monotonic()
    assert wait_gone(int(pgid)) == []  # within a poll of the execution's status and the kill grace
    assert time.monotonic() - cancelled_at < 10
    assert not process_alive(int(child))
    deadline = time.monotonic() + 20
    while not (failed := rows(store_url, execution_id, "event_type = 'action.failed'")) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert len(failed) == 1 and failed[0]["error"]["kind"] == "cancelled", failed
    assert wait(store_url, execution_id, timeout=5)["status"] == "cancelled"


def test_a_worker_killed_in_a_shell_step_leaves_nothing_half_done(env, store_url, worker_factory, tmp_path):
    ledger = tmp_path / "ledger"
    victim = worker_factory(env=env, concurrency=1, name="shell-victim@%h")
    execution_id = submit(env, PLAYBOOKS / "shell_ledger.yaml", ledger=str(ledger), key="payment-0001")
    [first_group] = wait_for_lines(Path(f"{ledger}.groups"), 1)
    wait_for_lines(ledger, 1)  # the key is appended; the step goes on working
    assert len(group_members(int(first_group))) >= 2
    victim.kill()  # SIGKILL of the worker's whole process group, in the middle of the step
    assert wait_gone(int(first_group)) == []  # the guard saw the worker die and killed the group
    worker_factory(env=env, concurrency=1, name="shell-survivor@%h")
    status = wait(store_url, execution_id, timeout=120)
    assert status["status"] == "completed", status
    assert ledger.read_text().split() == ["payment-0001"]  # appended once, by the killed attempt
    groups = Path(f"{ledger}.groups").read_text().split()
    assert len(groups) == 2 and all(wait_gone(int(g)) == [] for g in groups)
    assert rows(store_url, execution_id, "event_type = 'attempt.republished'")  # the sweeper ran it again
    [done] = rows(store_url, execution_id, "step = 'start' AND event_type = 'action.completed'")
    assert done["result"]["stdout"] == "already appended\n", done["result"]
