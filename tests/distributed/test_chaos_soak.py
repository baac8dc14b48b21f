"""A chaos soak: 30 mixed executions on real workers while processes die.

Three workers (two pool processes each) on Redis and PostgreSQL run, at once, loops of python
attempts, HTTP calls retried after 503s, paginations against the mock API and loops of
sub-playbooks, all submitted with `noetl-celery submit` before the workers start (so that every
pool process is busy whenever a fault comes). Meanwhile a seeded random sequence of SIGKILLs hits
pool processes, main processes and whole workers (a killed worker is replaced, so capacity
remains), and one worker's whole process group gets SIGTERM, as a supervisor's stop sends it; the
faults are spread over the work by its progress. Every execution must complete within a bounded
time, with every loop index, page and child exactly once and no failed attempt recorded as the
code's own error.
"""

from __future__ import annotations

import os
import random
import signal
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import text

from noetl_celery.runner import execution_status
from noetl_celery.store.db import get_engine
from tests.distributed.test_loop_delivery import loop_log
from tests.distributed.test_retry_delivery import step_rows
from tests.support.engines import submit
from tests.support.mockapi import start_mock_api
from tests.support.workers import process_alive

PLAYBOOKS = Path(__file__).resolve().parents[1] / "playbooks"
SEED = 20261125
KILLS = 8  # SIGKILLs: pool processes, main processes, whole workers
WORKERS = 3
PAGES = 35  # slow_pages.yaml: 35 pages of one item
FINISH_WITHIN = 300.0  # seconds from the last fault until every execution ended (and between faults)


def _plan(rng: random.Random) -> list[tuple[str, dict[str, Any]]]:
    """30 executions: (kind, the --set values), shuffled."""
    plan: list[tuple[str, dict[str, Any]]] = []
    plan += [("loop", {"n": rng.randint(20, 40), "sleep": rng.choice([0.1, 0.2, 0.3])}) for _ in range(12)]
    plan += [("retry", {}) for _ in range(6)]
    plan += [("pages", {"delay": 0.05}) for _ in range(6)]
    plan += [("sub", {"n": rng.randint(4, 8)}) for _ in range(6)]
    rng.shuffle(plan)
    return plan


PLAYBOOK_OF = {
    "loop": PLAYBOOKS / "loop_many.yaml",
    "retry": PLAYBOOKS / "retry_timeline.yaml",
    "pages": PLAYBOOKS / "slow_pages.yaml",
    "sub": PLAYBOOKS / "sub" / "parent.yaml",
}


def _event_counts(url: str, execution_id: int) -> Counter:
    with get_engine(url).connect() as conn:
        rows = conn.execute(
            text("SELECT step, event_type, iteration, page FROM noetl_event WHERE execution_id = :x"),
            {"x": execution_id},
        ).all()
    return Counter((r.step, r.event_type, r.iteration, r.page) for r in rows)


def _user_errors(url: str, execution_id: int) -> list[dict]:
    """Failed attempts that are not a lost delivery: what the code or a tool reported as its error,
    except the HTTP 503s the retry playbook asks for."""
    with get_engine(url).connect() as conn:
        rows = conn.execute(
            text(
                "SELECT id, step, event_type, iteration, page, attempt, error FROM noetl_event "
                "WHERE execution_id = :x ORDER BY id"
            ),
            {"x": execution_id},
        ).all()
    out = []
    for r in rows:
        if r.error is None:  # a JSON null
            continue
        error = r.error if isinstance(r.error, dict) else {"error": r.error}
        if r.event_type == "attempt.worker_lost" or error.get("kind") == "worker_lost":
            continue
        if r.step == "fetch" and r.event_type in ("action.failed", "retry.scheduled") and "503" in str(error):
            continue  # retry_timeline.yaml: attempts 1 and 2 get a 503 by design
        out.append(dict(r._mapping))
    return out


def _check(url: str, kind: str, sets: dict[str, Any], execution_id: int) -> list[str]:
    """What is wrong with one ended execution (empty: nothing)."""
    status = execution_status(url, execution_id)
    where = f"execution {execution_id} ({kind} {sets})"
    problems = []
    if status["status"] != "completed":
        return [f"{where}: {status['status']}: {status.get('error')}"]
    errors = _user_errors(url, execution_id)
    if errors:
        problems.append(f"{where}: failed attempts {errors}")
    if kind == "loop":
        n = sets["n"]
        per_index, kinds = loop_log(url, execution_id)
        missing = sorted(set(range(n)) - set(per_index))
        twice = sorted(i for i, c in per_index.items() if c > 1)
        if missing or twice or set(per_index) - set(range(n)):
            problems.append(f"{where}: work missing {missing}, more than once {twice}: {dict(per_index)}")
        if kinds["iterator.completed"] != 1 or kinds["step.completed"] != 1:
            problems.append(f"{where}: work closed {kinds['iterator.completed']}/{kinds['step.completed']} times")
        if status["results"]["work"]["results"] != [2 * i for i in range(n)]:
            problems.append(f"{where}: results {status['results']['work']['results']}")
    elif kind == "retry":
        done = [r for r in step_rows(url, execution_id, "fetch") if r["event_type"] == "action.completed"]
        if len(done) != 1:
            problems.append(f"{where}: fetch completed {len(done)} times: {done}")
    elif kind == "pages":
        pages = [
            r["page"]
            for r in step_rows(url, execution_id, "pages")
            if r["event_type"] in ("page.completed", "action.completed")
        ]
        if pages != list(range(1, PAGES + 1)):
            problems.append(f"{where}: pages completed {pages}")
        ids = [item["id"] for item in status["results"]["pages"]]
        if ids != list(range(1, PAGES + 1)):
            problems.append(f"{where}: collected ids {ids}")
    elif kind == "sub":
        n = sets["n"]
        counts = _event_counts(url, execution_id)
        per_index = Counter(
            {i: c for (step, kind_, i, _), c in counts.items() if step == "start" and kind_ == "iteration.completed"}
        )
        if sorted(per_index) != list(range(n)) or max(per_index.values(), default=0) != 1:
            problems.append(f"{where}: start iterations completed {dict(per_index)}")
        if status["results"].get("done") != {"values": [2 * i for i in range(n)]}:
            problems.append(f"{where}: done {status['results'].get('done')}")
        children = status["children"]
        if len(children) != n or {c["status"] for c in children} != {"completed"}:
            problems.append(f"{where}: children {[(c['execution_id'], c['status']) for c in children]}")
    return problems


HTTP = ("retry", "pages")
WORK_ROWS = ("iteration.completed", "page.completed", "action.completed")


def _work_rows(kind: str, sets: dict[str, Any]) -> int:
    """How many completed attempts (WORK_ROWS) an execution of the plan records."""
    return {"loop": sets.get("n", 0) + 1, "retry": 2, "pages": PAGES, "sub": sets.get("n", 0) + 1}[kind]


def _work_done(url: str, ids: list[int]) -> int:
    with get_engine(url).connect() as conn:
        return conn.execute(
            text("SELECT count(*) FROM noetl_event WHERE execution_id = ANY(:ids) AND event_type = ANY(:kinds)"),
            {"ids": ids, "kinds": list(WORK_ROWS)},
        ).scalar_one()


def _lost(url: str, ids: list[int], wait: float = 3.0) -> bool:
    """Whether an `attempt.worker_lost` row of these executions exists (waiting up to `wait` s:
    the worker's main process records it after the pool process's death)."""
    deadline = time.monotonic() + wait
    while True:
        with get_engine(url).connect() as conn:
            found = conn.execute(
                text(
                    "SELECT 1 FROM noetl_event WHERE execution_id = ANY(:ids) "
                    "AND event_type = 'attempt.worker_lost' LIMIT 1"
                ),
                {"ids": ids},
            ).first()
        if found is not None or time.monotonic() >= deadline:
            return found is not None
        time.sleep(0.2)


def _pool_children(worker) -> list[int]:
    return [pid for pid in worker.alive_group() if pid != worker.pid]


def _in_tool_sleep(pid: int) -> bool:
    """Whether a thread of this pool process sleeps in `time.sleep`: the loop playbook's tool
    sleeps, so the process is inside an attempt whose outcome is not recorded yet (an idle pool
    process waits reading its pipe; one in a decision does not sleep)."""
    try:
        threads = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return False
    for tid in threads:
        try:
            with open(f"/proc/{pid}/task/{tid}/wchan") as f:
                if "nanosleep" in f.read():
                    return True
        except OSError:
            continue
    return False


def _busy_child(workers, within: float = 5.0) -> int | None:
    """A live pool process that is inside an attempt's tool call (polled for up to `within` s)."""
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        busy = [c for w in workers if w.running() for c in _pool_children(w) if _in_tool_sleep(c)]
        if busy:
            return random.choice(busy)
        time.sleep(0.01)
    return None


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_30_mixed_executions_through_random_kills_and_a_group_sigterm(env, store_url, worker_factory):
    rng = random.Random(SEED)
    # a short visibility timeout: Redis hands a killed worker's messages out again within seconds
    worker_env = {**env, "NOETL_VISIBILITY_TIMEOUT": "8", "NOETL_RESTORE_INTERVAL": "2"}
    serial = iter(range(1, 1000))

    def new_worker():
        return worker_factory(env=worker_env, concurrency=2, name=f"soak-{next(serial)}-{os.getpid()}@%h")

    plan = _plan(rng)
    expected = sum(_work_rows(kind, sets) for kind, sets in plan)
    faults: list[str] = []
    with start_mock_api() as api:
        # all 30 wait in the queue before the workers start: every fault falls among attempts in flight
        with ThreadPoolExecutor(3) as pool:
            ids = list(
                pool.map(
                    lambda item: submit(
                        env, PLAYBOOK_OF[item[0]], **({**item[1], "api_url": api.url} if item[0] in HTTP else item[1])
                    ),
                    plan,
                )
            )
        started = time.monotonic()
        workers = [new_worker() for _ in range(WORKERS)]
        # the fault sequence: KILLS SIGKILLs and, at a random place among them, one group SIGTERM
        sequence = [rng.choice(["child", "child", "main", "group"]) for _ in range(KILLS)]
        sequence.insert(rng.randint(2, KILLS - 2), "group-sigterm")
        print(f"seed {SEED}: faults {sequence}")
        terminating = None
        extra_kills = 0
        for k, fault in enumerate(sequence):
            # spread over the work: after its share of the attempts completed, and a random pause more
            due = expected * (k + 1) // (len(sequence) + 1)
            pause_until = time.monotonic() + rng.uniform(0.5, 2.0)
            deadline = time.monotonic() + FINISH_WITHIN
            while _work_done(store_url, ids) < due or time.monotonic() < pause_until:
                assert time.monotonic() < deadline, f"no progress to {due} of {expected} completed attempts"
                time.sleep(0.1)
            live = [w for w in workers if w.running()]
            victim = rng.choice(live)
            if fault == "child":
                children = _pool_children(victim)
                if not children:
                    fault = "main"  # between a pool process's death and its replacement
                else:
                    # a pool process killed between attempts (in a decision, or idle) interrupts
                    # none: aim at one inside a tool call, the victim's own if it has one
                    pid = _busy_child([victim], within=1.0) or _busy_child(workers) or rng.choice(sorted(children))
                    os.kill(pid, signal.SIGKILL)
                    faults.append(f"{time.monotonic() - started:5.1f} s: SIGKILL pool process {pid}")
                    # until one attempt was interrupted, kill another busy one (at most 6 more)
                    while not _lost(store_url, ids) and extra_kills < 6:
                        pid = _busy_child(workers)
                        if pid is None:
                            break
                        extra_kills += 1
                        os.kill(pid, signal.SIGKILL)
                        faults.append(f"{time.monotonic() - started:5.1f} s: SIGKILL pool process {pid} (again)")
                    continue
            if fault == "main":
                assert victim.pid is not None
                os.kill(victim.pid, signal.SIGKILL)  # its pool processes are orphaned
                faults.append(
                    f"{time.monotonic() - started:5.1f} s: SIGKILL main process {victim.pid} of {victim.node}"
                )
            elif fault == "group":
                victim.kill()
                faults.append(f"{time.monotonic() - started:5.1f} s: SIGKILL worker {victim.node} (whole group)")
            else:
                assert victim.pgid is not None
                os.killpg(victim.pgid, signal.SIGTERM)  # systemd's, supervisord stopasgroup's stop
                terminating = victim
                faults.append(f"{time.monotonic() - started:5.1f} s: SIGTERM process group of {victim.node}")
            workers.remove(victim)
            workers.append(new_worker())  # capacity remains
        last_fault = time.monotonic()
        if terminating is not None and terminating.proc is not None:
            code = terminating.proc.wait(60)  # its warm shutdown lets the running attempts finish
            faults.append(f"{terminating.node} exited {code} after the group SIGTERM")
            assert code == 0, terminating.log_tail()
        for line in faults:
            print(line)
        pending = dict(zip(ids, plan, strict=True))
        while pending:
            with get_engine(store_url).connect() as conn:
                states = dict(
                    conn.execute(
                        text("SELECT execution_id, status FROM noetl_execution WHERE execution_id = ANY(:ids)"),
                        {"ids": list(pending)},
                    ).all()
                )
            for execution_id, state in states.items():
                if state != "running":
                    pending.pop(execution_id)
            if time.monotonic() - last_fault > FINISH_WITHIN:
                break
            time.sleep(0.5)
        ended = time.monotonic()
    assert not pending, f"still running {FINISH_WITHIN:.0f} s after the last fault: {pending}"
    problems = [
        p
        for execution_id, (kind, sets) in zip(ids, plan, strict=True)
        for p in _check(store_url, kind, sets, execution_id)
    ]
    assert not problems, "\n".join(problems)
    assert sum(process_alive(w.pid) for w in workers if w.pid) == WORKERS
    with get_engine(store_url).connect() as conn:
        recoveries = dict(
            conn.execute(
                text(
                    "SELECT event_type, count(*) FROM noetl_event WHERE execution_id = ANY(:ids) "
                    "AND event_type IN ('attempt.worker_lost', 'attempt.republished') GROUP BY event_type"
                ),
                {"ids": ids},
            ).all()
        )
    print(f"recoveries recorded: {recoveries}")
    # a SIGKILL of a pool process interrupted an attempt (the fault loop kills busy ones until one does)
    assert recoveries.get("attempt.worker_lost", 0) >= 1, recoveries
    print(
        f"30 executions completed {ended - started:.1f} s after the workers' start, "
        f"{ended - last_fault:.1f} s after the last fault; "
        f"kinds {Counter(kind for kind, _ in plan)}"
    )
