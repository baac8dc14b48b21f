"""A supervisor's stop: SIGTERM to the worker's whole process group while attempts run.

systemd (`KillMode=control-group`, its default), supervisord (`stopasgroup`) and `tini -g` send
SIGTERM to every process of the worker, the pool children included. Billiard's handler in a
child raised SystemExit inside the running python code, which recorded it as the code's own
error (`exception: SystemExit: -241`, not retryable) and failed the execution. Here the running
attempts finish in the worker's warm shutdown, on that worker, and the execution completes.
"""

from __future__ import annotations

import os
import re
import signal
import time
from pathlib import Path

import pytest
from sqlalchemy import text

from noetl_celery.runner import wait
from noetl_celery.store.db import get_engine
from tests.support.engines import submit
from tests.support.playbooks import range_loop

PLAYBOOK = range_loop(
    "group_stop",
    workload='{n: 6, marks: "", ticks: 8}',
    max_in_flight=6,
    tool="""      kind: python
      args: {x: "{{ iter.x }}", marks: "{{ marks }}", ticks: "{{ ticks }}"}
      code: |
        import os, time
        open(os.path.join(marks, f"{x}.{os.getpid()}"), "w").close()
        for _ in range(ticks):
            time.sleep(0.5)
        result = x * 2
""",
)
N = 6
TICKS = 8  # half-second sleeps per attempt: 4 s
WARM_WINDOW = 30.0  # seconds the stopped worker may take (its attempts need 4 s)


def _rows(url: str, execution_id: int) -> list[dict]:
    with get_engine(url).connect() as conn:
        result = conn.execute(
            text(
                "SELECT event_type, step, iteration, worker, error, meta FROM noetl_event "
                "WHERE execution_id = :x ORDER BY id"
            ),
            {"x": execution_id},
        )
        return [dict(r._mapping) for r in result]


def _marks(marks: Path) -> list[tuple[int, int]]:
    """(iteration, pid) of every attempt that started."""
    out = []
    for entry in marks.iterdir():
        index, _, pid = entry.name.partition(".")
        out.append((int(index), int(pid)))
    return out


def _deferred(worker) -> set[int]:
    """The pool processes of a worker that logged a first SIGTERM let pass."""
    return {int(pid) for pid in re.findall(r"pool process (\d+): SIGTERM received", worker.log_text())}


def _start(tmp_path, env, worker_factory) -> tuple:
    """Two workers of two processes; an execution whose first attempts run on both processes of the
    one to stop.
    Returns (stopped, other, its pool pids, marks directory, execution id)."""
    stopped = worker_factory(env=env, concurrency=2, name=f"stopped-{os.getpid()}@%h")
    other = worker_factory(env=env, concurrency=2, name=f"other-{os.getpid()}@%h")
    children = set(stopped.alive_group()) - {stopped.pid}
    assert len(children) == 2, stopped.alive_group()
    # both pool processes running an attempt: none is between taking a job and starting it, when
    # billiard's own handler still ends it on a SIGTERM (the attempt then runs again elsewhere)
    marks, execution_id = _submit_until_running(tmp_path, env, stopped, children)
    return stopped, other, children, marks, execution_id


def _submit_until_running(tmp_path, env, worker, pids: set[int]) -> tuple[Path, int]:
    """Submit PLAYBOOK and wait until attempts run in each of `pids` (processes of `worker`).
    Returns the marks directory and the execution id."""
    marks = tmp_path / "marks"
    marks.mkdir()
    playbook = tmp_path / "stop.yaml"
    playbook.write_text(PLAYBOOK)
    execution_id = submit(env, playbook, n=N, marks=str(marks), ticks=TICKS)
    deadline = time.monotonic() + 60
    while {pid for _, pid in _marks(marks)} & pids != pids:
        assert time.monotonic() < deadline, f"attempts did not start in {pids} of {worker.node}:\n{worker.log_tail()}"
        time.sleep(0.05)
    return marks, execution_id


def _completed(store_url: str, execution_id: int) -> tuple[list[dict], dict[int, dict]]:
    """The execution's rows and its iteration.completed rows by index, once it completed with
    every index exactly once and no attempt failed."""
    status = wait(store_url, execution_id, timeout=120)
    assert status["status"] == "completed", status
    assert status["results"]["work"]["results"] == [2 * i for i in range(N)]
    rows = _rows(store_url, execution_id)
    failures = [r for r in rows if r["event_type"].endswith(".failed") or r["event_type"] == "retry.scheduled"]
    assert not failures, failures
    assert "SystemExit" not in str([r for r in rows if r["event_type"] != "attempt.worker_lost"])
    completed = [r for r in rows if r["event_type"] == "iteration.completed"]
    done = {r["iteration"]: r for r in completed}
    assert sorted(done) == list(range(N)) and len(completed) == N
    return rows, done


@pytest.mark.timeout(300)
def test_a_process_group_sigterm_lets_running_attempts_finish(tmp_path, env, worker_factory, store_url):
    stopped, other, children, marks, execution_id = _start(tmp_path, env, worker_factory)
    os.killpg(stopped.pgid, signal.SIGTERM)  # what systemd, supervisord stopasgroup and tini -g do
    signalled = time.monotonic()
    running_there = {index: pid for index, pid in _marks(marks) if pid in children}
    assert stopped.proc is not None
    returncode = stopped.proc.wait(WARM_WINDOW)
    took = time.monotonic() - signalled
    assert returncode == 0, stopped.log_tail()
    assert not stopped.alive_group(), "a pool process outlived its worker"

    rows, done = _completed(store_url, execution_id)
    assert not [r for r in rows if r["error"] is not None], rows
    for index, pid in running_there.items():  # finished where they ran, in the warm shutdown
        assert done[index]["worker"] == stopped.node, (index, done[index])
        assert done[index]["meta"]["pid"] == pid, (index, done[index])
    assert "SIGTERM received; its running attempt finishes first" in stopped.log_text(), stopped.log_tail()
    assert other.running()
    print(f"stopped worker exited {took:.1f} s after the group SIGTERM; {len(running_there)} attempt(s) finished there")


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_second_group_sigterm_interrupts_attempts_which_run_again_elsewhere(tmp_path, env, worker_factory, store_url):
    """The impatient stop: a second SIGTERM ends the pool processes at once. Their attempts are
    recorded as lost deliveries of a stopping worker (never as the code's error) and run again on
    the other worker. Eager attempts off: an attempt a message runs itself (the start's message
    runs the first iteration) is sent again by that message's redelivery, with no lost-delivery
    row of its own (tests/distributed/test_eager_attempts.py)."""
    env = {**env, "NOETL_EAGER_WINDOW": "0"}
    stopped, other, children, marks, execution_id = _start(tmp_path, env, worker_factory)
    os.killpg(stopped.pgid, signal.SIGTERM)
    # every process running an attempt must have taken the first SIGTERM before the second is
    # sent: two SIGTERMs pending in one process at once are delivered as one
    deadline = time.monotonic() + 10
    while not (running := {pid for _, pid in _marks(marks) if pid in children}) <= _deferred(stopped):
        assert time.monotonic() < deadline, (running, stopped.log_tail())
        time.sleep(0.05)
    os.killpg(stopped.pgid, signal.SIGTERM)
    assert stopped.proc is not None
    signalled = time.monotonic()
    stopped.proc.wait(WARM_WINDOW)
    took = time.monotonic() - signalled
    interrupted = {index for index, pid in _marks(marks) if pid in children}

    rows, done = _completed(store_url, execution_id)
    lost = [r for r in rows if r["event_type"] == "attempt.worker_lost"]
    # every attempt seen running there is interrupted; one its process had only taken may be too
    assert lost and interrupted <= {r["iteration"] for r in lost}, (lost, interrupted)
    for row in lost:
        assert row["error"]["kind"] == "worker_lost", row
        assert row["error"]["message"].startswith("the worker was shutting down"), row
    for index in {r["iteration"] for r in lost}:
        assert done[index]["worker"] == other.node, (index, done[index])
    print(f"stopped worker exited {took:.1f} s after the second SIGTERM; {len(lost)} attempt(s) ran again")


@pytest.mark.timeout(300)
def test_a_solo_worker_stops_at_one_sigterm_after_its_running_attempt(tmp_path, env, worker_factory, store_url):
    """`-P solo` runs attempts in the worker's main process, and Celery sends it
    `worker_process_init` as it does a pool child: the SIGTERM of `systemctl stop` or `kill` is
    still the worker's warm shutdown (its running attempt finishes, then it exits), never let pass
    as a pool child lets its first one."""
    solo = worker_factory(env=env, pool="solo", concurrency=1, name=f"solo-{os.getpid()}@%h")
    other = worker_factory(env=env, concurrency=2, name=f"other-{os.getpid()}@%h")
    marks, execution_id = _submit_until_running(tmp_path, env, solo, {solo.pid})
    running_there = [index for index, pid in _marks(marks) if pid == solo.pid]
    assert solo.proc is not None
    solo.proc.send_signal(signal.SIGTERM)
    signalled = time.monotonic()
    returncode = solo.proc.wait(WARM_WINDOW)
    took = time.monotonic() - signalled
    assert returncode == 0, solo.log_tail()
    assert "SIGTERM received; its running attempt finishes first" not in solo.log_text(), solo.log_tail()

    _, done = _completed(store_url, execution_id)
    for index in running_there:  # finished where it ran, in the warm shutdown
        assert done[index]["worker"] == solo.node, (index, done[index])
    assert other.running()
    print(f"solo worker exited {took:.1f} s after its SIGTERM; {len(running_there)} attempt(s) finished there")
