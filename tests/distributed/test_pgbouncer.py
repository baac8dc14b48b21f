"""The engine through PgBouncer in transaction pooling mode: the loop delivery tests of
test_loop_delivery.py (a worker killed mid-loop, one iteration a message or batched; outcomes
through the on_event queue; on Redis: the broker does not meet the pooler, and the RabbitMQ
variants run against PostgreSQL directly in test_loop_delivery.py), with the
workers, the submitting command and the sweeper connected to a PgBouncer of the test's own
(pool_mode = transaction) instead of PostgreSQL. Nothing relies on session state there: the
decisions' BEGIN rides on their first statement, the sweeper's lock is transaction-level and its
timeouts are SET LOCAL, and no statement is prepared on a server connection (NOETL_PG_PREPARE=auto
sees the pooler: tests/test_prepared_statements.py). Each test checks that
the store's traffic did go through PgBouncer (its admin console's counters)."""

from __future__ import annotations

import pytest
from sqlalchemy.engine import make_url

from noetl_celery.store.db import migrate
from tests.distributed import test_loop_delivery
from tests.support import pgbouncer as bouncers

pytestmark = [
    pytest.mark.real_workers,
    pytest.mark.skipif(bouncers.available() is None, reason="pgbouncer is not installed (apt-get install pgbouncer)"),
]

test_outcomes_through_the_on_event_queue = test_loop_delivery.test_outcomes_through_the_on_event_queue


@pytest.mark.parametrize(
    "playbook", [test_loop_delivery.SHORT_LEASE, test_loop_delivery.BATCHED], ids=["one-per-message", "batched"]
)
def test_a_worker_killed_mid_loop_loses_no_iteration(playbook, env, store_url, worker_factory):
    test_loop_delivery.test_a_worker_killed_mid_loop_loses_no_iteration(
        "redis", playbook, env, store_url, worker_factory
    )


@pytest.fixture(scope="module")
def bouncer(postgres_url):
    with bouncers.pgbouncer(postgres_url) as running:
        yield running


@pytest.fixture(scope="module")
def store_url(postgres_url, bouncer) -> str:
    """The session's database, migrated directly, then reached through PgBouncer only."""
    migrate(postgres_url)
    return bouncer.url(postgres_url)


@pytest.fixture(autouse=True)
def through_pgbouncer(bouncer, postgres_url):
    """The test's transactions went through PgBouncer (and each of them got a server connection
    from its pool for one transaction only: transaction mode)."""
    database = make_url(postgres_url).database
    before = bouncer.stats(database).get("total_xact_count", 0)
    yield
    after = bouncer.stats(database).get("total_xact_count", 0)
    assert after - before > 100, f"only {after - before} transactions went through PgBouncer"
