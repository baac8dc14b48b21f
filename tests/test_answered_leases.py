"""A decision's only message carries the decision row's key (TaskMessage.lease), and the decision
that records its outcome deletes that lease in the same write: the sweeper never reads the leases
of a chain or of a loop's later iterations. A decision of several messages, or a message sent
again from the store, leaves its lease to the sweeper, which settles it as before. Run through the
in-process harness on SQLite and PostgreSQL (the delivery tests with real workers, which lose,
kill and redeliver, run with it too)."""

from __future__ import annotations

from datetime import UTC, timedelta
from pathlib import Path

from sqlalchemy import select

from noetl_celery.compiler import compile_playbook
from noetl_celery.engine.decision import orchestrator
from noetl_celery.engine.messages import Dispatch, TaskMessage
from noetl_celery.engine.recovery import sweeper
from noetl_celery.runner import create_execution
from noetl_celery.store import leases, repo
from noetl_celery.store.db import transaction
from tests.support.harness import Harness

CHAIN = """
apiVersion: noetl.io/v10
kind: Playbook
metadata: {name: answered_chain}
workflow:
  - step: start
    tool: {kind: python, code: "result = 1"}
    next: {arcs: [{step: two}]}
  - step: two
    tool: {kind: python, code: "result = 2"}
    next: {arcs: [{step: end}]}
  - step: end
"""
LOOP = Path(__file__).parent / "playbooks" / "loop_many.yaml"


def lease_keys(url: str) -> set[tuple[int, str]]:
    with transaction(url) as conn:
        return {tuple(r) for r in conn.execute(select(repo.LEASES.c.execution_id, repo.LEASES.c.event_id))}


def started_chain(url: str) -> tuple[int, Dispatch, list[dict]]:
    """A new execution of CHAIN, its start decided: its id, its one message, and the rows that
    keep a dispatch list."""
    execution_id = create_execution(compile_playbook("answered_chain.yaml", text=CHAIN), url)
    (first,) = orchestrator.handle_event(url, orchestrator.start_payload(execution_id))
    with transaction(url) as conn:
        cause = [r for r in repo.list_events(conn, execution_id) if r["meta"] and r["meta"].get("dispatch")]
    return execution_id, first, cause


def test_each_only_message_carries_its_decisions_key_and_its_outcome_deletes_the_lease(either_store):
    url = either_store
    execution_id, first, cause = started_chain(url)
    assert [r["event_id"] for r in cause] == [first.message["lease"]]  # the row that holds the lease
    assert "lease" not in cause[0]["meta"]["dispatch"][0]["message"]  # never stored
    assert lease_keys(url) == {(execution_id, first.message["lease"])}

    harness = Harness(url)
    harness.send([first])
    harness.step()  # the first step's outcome: its decision deletes that lease, writes the next one's
    (second,) = [dispatch for _, _, dispatch in harness._queue]
    assert lease_keys(url) == {(execution_id, second.message["lease"])}
    harness.drain()
    assert runner_status(url, execution_id) == "completed"
    assert lease_keys(url) == set()  # nothing left for the sweeper


def test_a_decision_of_several_messages_keeps_its_lease_for_the_sweeper(either_store):
    url = either_store
    plan = compile_playbook(LOOP, overrides={"n": 12, "cap": 4})
    harness = Harness(url)
    execution_id = harness.start(plan)
    harness.drain()
    assert runner_status(url, execution_id) == "completed"
    ran = [TaskMessage.from_dict(d.message) for d in harness.ran if d.kind == "run"]
    unanswered = {m.parent_event_id for m in ran if m.lease is None}
    left = lease_keys(url)
    assert left and all(x == execution_id for x, _ in left)
    assert len(left) < len(ran)  # the later iterations' leases went with their outcomes
    with transaction(url) as conn:
        leases.expire(conn, repo.utcnow(), execution_id)
    result = sweeper.sweep(url)
    assert result.republished == [] and result.lost == [] and result.cleared == len(left)
    assert lease_keys(url) == set() and unanswered  # the loop's start sent several messages


def test_each_message_of_a_decision_of_several_carries_the_lease_it_shares(either_store):
    url = either_store
    plan = compile_playbook(LOOP, overrides={"n": 12})
    harness = Harness(url)
    execution_id = harness.start(plan)
    harness.step()  # the first step's outcome: the loop sends its twelve iterations at once
    firsts = [dispatch for _, _, dispatch in harness._queue]
    harness._queue.clear()
    assert len(firsts) == 12
    messages = [TaskMessage.from_dict(d.message) for d in firsts]
    (key,) = {m.shares for m in messages}
    assert key is not None and all(m.lease is None for m in messages)  # shared: no outcome settles it
    with transaction(url) as conn:
        cause = [r for r in repo.list_events(conn, execution_id) if r["event_id"] == key]
        assert cause and all("shares" not in d["message"] for d in cause[0]["meta"]["dispatch"])  # never stored
        before = leases.deadline(conn, execution_id, key)
        assert before is not None
        leases.expire(conn, repo.utcnow(), execution_id)
    # a worker takes one of them late: the shared lease runs from now, one lease long
    with transaction(url) as conn:
        assert not leases.taken(conn, execution_id, messages[2].shares, messages[2].outcome_key(), 30.0)
    with transaction(url) as conn:
        moved = leases.deadline(conn, execution_id, key)
        assert moved is not None
        assert (moved if moved.tzinfo else moved.replace(tzinfo=UTC)) > repo.utcnow() + timedelta(seconds=25)
        # taken again within TAKEN_STEP: the lease is not rewritten
        assert not leases.taken(conn, execution_id, key, messages[3].outcome_key(), 30.0)
        assert leases.deadline(conn, execution_id, key) == moved
    harness.send(firsts[:1])
    harness.step()  # one outcome of the twelve: the shared lease stays for the others
    assert (execution_id, key) in lease_keys(url)
    harness.send(firsts[1:])
    harness.drain()
    assert runner_status(url, execution_id) == "completed"


def test_a_message_sent_again_from_the_store_leaves_its_lease_to_the_sweeper(either_store):
    url = either_store
    execution_id, first, (cause,) = started_chain(url)
    stored = cause["meta"]["dispatch"]
    again = Dispatch.from_dict(stored[0]).as_replay()
    assert again.message.get("lease") is None
    harness = Harness(url)
    harness.send([again])
    harness.step()
    assert (execution_id, first.message["lease"]) in lease_keys(url)  # the sweeper's to settle
    with transaction(url) as conn:
        leases.expire(conn, repo.utcnow(), execution_id)
    assert sweeper.sweep(url).cleared >= 1
    assert (execution_id, first.message["lease"]) not in lease_keys(url)


def runner_status(url: str, execution_id: int) -> str:
    with transaction(url) as conn:
        return repo.get_execution(conn, execution_id)["status"]
