"""`noetl-celery resume` continues a stopped loop, with real Redis, real PostgreSQL and real worker
processes: completed iterations are not run again, failed and never-dispatched ones run, the loop
completes once and its arcs run."""

from __future__ import annotations

import time
from collections import Counter
from pathlib import Path

from sqlalchemy import text

from noetl_celery.runner import cancel, wait
from noetl_celery.store.db import get_engine
from tests.support.engines import cli, submit

PLAYBOOKS = Path(__file__).resolve().parents[1] / "playbooks"
N = 12
FAILING = {x for x in range(N) if x % 3 == 1}


def rows(url: str, execution_id: int, where: str = "TRUE") -> list[dict]:
    with get_engine(url).connect() as conn:
        result = conn.execute(
            text(f"SELECT * FROM noetl_event WHERE execution_id = :x AND {where} ORDER BY id"), {"x": execution_id}
        )
        return [dict(r._mapping) for r in result]


def attempts_per_index(url: str, execution_id: int) -> Counter:
    """Attempts that reached a worker and reported, per loop index."""
    done = rows(url, execution_id, "step = 'work' AND event_id LIKE '%.done' AND iteration IS NOT NULL")
    return Counter(r["iteration"] for r in done)


def test_resume_runs_the_failed_iterations_of_a_failed_loop(env, store_url, worker_factory, tmp_path):
    worker_factory(env=env, concurrency=2, name="resume-loop@%h")
    gate = tmp_path / "gate"
    execution_id = submit(env, PLAYBOOKS / "loop_resume.yaml", n=N, gate=str(gate))
    status = wait(store_url, execution_id, timeout=90)
    assert status["status"] == "failed", status
    assert status["failed_step"] == "work" and status["error"]["kind"] == "loop", status["error"]
    before = attempts_per_index(store_url, execution_id)
    assert set(before) == set(range(N)) and max(before.values()) == 1, before

    gate.write_text("open")
    proc = cli(["resume", str(execution_id)], env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "resumed (epoch 1)" in proc.stdout
    status = wait(store_url, execution_id, timeout=90)
    assert status["status"] == "completed", status
    assert status["results"]["work"]["results"] == [x * 10 for x in range(N)]
    assert status["results"]["after"] == sum(x * 10 for x in range(N))

    after = attempts_per_index(store_url, execution_id)
    assert {i: after[i] - before[i] for i in range(N)} == {i: (1 if i in FAILING else 0) for i in range(N)}
    retried = rows(store_url, execution_id, "step = 'work' AND event_type = 'iteration.completed' AND attempt = 2")
    assert sorted(r["iteration"] for r in retried) == sorted(FAILING)
    ends = rows(store_url, execution_id, "step = 'work' AND event_type = 'iterator.completed'")
    assert [(r["status"], r["event_id"].endswith(".e1")) for r in ends] == [("failed", True), ("completed", False)]
    assert len(rows(store_url, execution_id, "step = 'after' AND event_type = 'step.completed'")) == 1
    assert len(rows(store_url, execution_id, "event_type = 'execution.completed'")) == 1


def test_resume_after_cancel_runs_the_rest_of_the_loop_once(env, store_url, worker_factory, tmp_path):
    worker_factory(env=env, concurrency=2, name="resume-cancel@%h")
    gate = tmp_path / "gate"
    gate.write_text("open")
    hold = tmp_path / "hold"  # iterations 8 and up wait while it exists: the loop cannot end before the cancel
    hold.write_text("held")
    n = 40
    execution_id = submit(
        env, PLAYBOOKS / "loop_resume.yaml", n=n, gate=str(gate), pause=0.5, hold=str(hold), hold_from=8
    )
    deadline = time.monotonic() + 90
    while len(rows(store_url, execution_id, "event_type = 'iteration.completed'")) < 5:
        assert time.monotonic() < deadline, rows(store_url, execution_id)
        time.sleep(0.1)
    proc = cli(["cancel", str(execution_id), "--reason", "pause"], env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert wait(store_url, execution_id, timeout=30)["status"] == "cancelled"
    hold.unlink()  # the attempts held in flight finish now, after the cancel
    started = {r["iteration"] for r in rows(store_url, execution_id, "event_type = 'iteration.started'")}
    assert len(started) < n  # the cancel stopped the loop part way
    deadline = time.monotonic() + 60
    while not started <= set(attempts_per_index(store_url, execution_id)):  # they report (recorded, not acted on)
        assert time.monotonic() < deadline, (started, attempts_per_index(store_url, execution_id))
        time.sleep(0.1)

    proc = cli(["resume", str(execution_id)], env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    status = wait(store_url, execution_id, timeout=120)
    assert status["status"] == "completed", status
    assert status["results"]["work"]["results"] == [x * 10 for x in range(n)]
    completed = Counter(r["iteration"] for r in rows(store_url, execution_id, "event_type = 'iteration.completed'"))
    assert set(completed) == set(range(n)) and max(completed.values()) == 1, completed
    assert len(rows(store_url, execution_id, "step = 'work' AND event_type = 'iterator.completed'")) == 1
    assert len(rows(store_url, execution_id, "step = 'after' AND event_type = 'step.completed'")) == 1


def test_resume_after_cancel_runs_the_cancelled_sub_playbooks_again_and_completes_once(env, store_url, worker_factory):
    worker_factory(env=env, concurrency=2, name="resume-sub@%h")
    n = 12
    execution_id = submit(env, PLAYBOOKS / "sub" / "resume_parent.yaml", n=n, seconds=1.5)
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline:
        if rows(store_url, execution_id, "event_type = 'iteration.completed'"):
            break
        time.sleep(0.1)
    assert execution_id in cancel(store_url, execution_id, "pause")
    status = wait(store_url, execution_id, timeout=30)
    assert status["status"] == "cancelled", status
    cancelled = [c for c in status["children"] if c["status"] == "cancelled"]
    assert cancelled, status["children"]  # children were running: they ended with their parent
    started = {r["iteration"] for r in rows(store_url, execution_id, "event_type = 'iteration.started'")}
    assert len(started) < n  # the cancel stopped the loop part way

    proc = cli(["resume", str(execution_id)], env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    status = wait(store_url, execution_id, timeout=120)
    assert status["status"] == "completed", status
    assert status["results"]["done"] == {"count": n}
    completed = Counter(r["iteration"] for r in rows(store_url, execution_id, "event_type = 'iteration.completed'"))
    assert set(completed) == set(range(n)) and max(completed.values()) == 1, completed
    again = rows(store_url, execution_id, "event_type = 'iteration.completed' AND attempt = 2")
    assert len(again) == len(cancelled)  # each cancelled child's iteration ran once more, as a new child
    children = Counter(c["status"] for c in wait(store_url, execution_id, timeout=5)["children"])
    assert children == {"completed": n, "cancelled": len(cancelled)}, children
    assert len(rows(store_url, execution_id, "step = 'start' AND event_type = 'iterator.completed'")) == 1
    assert len(rows(store_url, execution_id, "step = 'done' AND event_type = 'step.completed'")) == 1
    assert len(rows(store_url, execution_id, "event_type = 'execution.completed'")) == 1
