"""Eager attempts (NOETL_EAGER_WINDOW, engine/transport/eager.py): the worker that decides an attempt due now
runs it in the same job, without a broker hop. Real Redis or RabbitMQ, real PostgreSQL, real
worker processes; the submitting command and the workers share the setting, as a deployment does.
"""

from __future__ import annotations

from collections import Counter

import pytest
from sqlalchemy import text

from noetl_celery.runner import wait
from noetl_celery.store.db import get_engine
from tests.support.engines import submit
from tests.support.playbooks import marked_chain, retry_once
from tests.support.services import on_both_brokers

DIE_ONCE = """import os
if die_once and not os.path.exists(die_once):
    open(die_once, "w").close()
    os._exit(3)
"""
STEPS = ["start", "middle", "last"]


LOOP = """
apiVersion: noetl.io/v10
kind: Playbook
metadata: {name: eager_loop}
workload: {n: 40}
workflow:
  - step: start
    loop: {in: "{{ range(n) | list }}", iterator: i, spec: {mode: parallel, max_in_flight: 2}}
    tool: {kind: python, args: {i: "{{ i }}"}, code: "result = i"}
"""


def rows(url: str, execution_id: int, where: str = "TRUE") -> list[dict]:
    with get_engine(url).connect() as conn:
        result = conn.execute(
            text(f"SELECT * FROM noetl_event WHERE execution_id = :x AND {where} ORDER BY id"), {"x": execution_id}
        )
        return [dict(r._mapping) for r in result]


def _with_window(env: dict[str, str], window: str) -> dict[str, str]:
    return {**env, "NOETL_EAGER_WINDOW": window}


@on_both_brokers
@pytest.mark.parametrize("window", ["0", "2"])
def test_a_chain_a_zero_delay_retry_and_a_loop_run_in_the_message_that_decided_them(
    broker, window, env, store_url, worker_factory, tmp_path
):
    env = _with_window(env, window)
    worker_factory(env=env, concurrency=2)
    marks = tmp_path / "marks.txt"
    # the last step allows longer than the first message's time limits: it is never taken
    (tmp_path / "chain.yaml").write_text(marked_chain("eager_chain", STEPS, timeout=60))
    (tmp_path / "retry.yaml").write_text(retry_once("eager_retry", delay=0, then="after"))
    (tmp_path / "loop.yaml").write_text(LOOP)

    chain = submit(env, tmp_path / "chain.yaml", marks=str(marks))
    retry = submit(env, tmp_path / "retry.yaml")
    loop = submit(env, tmp_path / "loop.yaml")
    for execution_id in (chain, retry, loop):
        assert wait(store_url, execution_id, timeout=60)["status"] == "completed"
    assert marks.read_text().splitlines() == ["start", "middle", "last"]

    steps = {r["step"]: r["queue_id"] for r in rows(store_url, chain, "event_type = 'action.completed'")}
    attempts = [
        (r["step"], r["attempt"], r["queue_id"])
        for r in rows(store_url, retry, "event_type IN ('action.failed', 'action.completed')")
    ]
    assert [a[:2] for a in attempts] == [("start", 1), ("start", 2), ("after", 1)]
    done = rows(store_url, loop, "event_type = 'iteration.completed'")
    assert Counter(r["iteration"] for r in done) == Counter(range(40))
    assert len(rows(store_url, loop, "iteration IS NOT NULL")) == 2 * 40
    loop_messages = {r["queue_id"] for r in done}

    if window == "0":  # off (the default): every attempt is a message of its own
        assert len(set(steps.values())) == 3
        assert len({a[2] for a in attempts}) == 3
        assert len(loop_messages) == 40
    else:
        assert steps["start"] == steps["middle"] != steps["last"]  # `last` did not fit the limits
        assert len({a[2] for a in attempts}) == 1  # the retry and the next step: one message
        assert len(loop_messages) <= 4  # each lane of the loop went on in its own message


@on_both_brokers
def test_a_process_killed_in_an_eager_attempt_sends_that_attempt_again_at_once(
    broker, env, store_url, worker_factory, tmp_path
):
    env = _with_window(env, "2")
    worker_factory(env=env, concurrency=2)
    marks, die_once = tmp_path / "marks.txt", tmp_path / "died"
    (tmp_path / "chain.yaml").write_text(marked_chain("eager_chain", STEPS, last=DIE_ONCE))
    execution_id = submit(env, tmp_path / "chain.yaml", marks=str(marks), die_once=str(die_once))
    # the sweeper would send `last` again only after its lease (30 + 16 s); the redelivered
    # message of `start` replays through `middle`, which it ran, to `last`, which it did not finish
    status = wait(store_url, execution_id, timeout=30)
    assert status["status"] == "completed", status
    assert die_once.exists()
    assert marks.read_text().splitlines() == ["start", "middle", "last", "last"]
    completed = rows(store_url, execution_id, "event_type = 'action.completed'")
    assert [r["step"] for r in completed] == ["start", "middle", "last"]
    assert completed[0]["queue_id"] == completed[1]["queue_id"] != completed[2]["queue_id"]
    # the loss is counted against `last`, the attempt the process was in, not against `start`,
    # the message's own attempt, which was recorded
    [lost] = rows(store_url, execution_id, "event_type = 'attempt.worker_lost'")
    assert (lost["step"], lost["attempt"], lost["meta"]["delivery"]) == ("last", 1, 1)
    assert lost["event_id"] == completed[2]["event_id"].removesuffix(".done") + ".lost.1"
    assert "run eagerly" in lost["error"]["message"]
    assert rows(store_url, execution_id, "event_type = 'attempt.republished'") == []
