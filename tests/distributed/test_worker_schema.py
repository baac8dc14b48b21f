"""A worker refuses, at start, an event store whose schema is behind this version, as every
CLI command does: one line saying what to run, and it never reports ready."""

from __future__ import annotations

import pytest

from noetl_celery.store.check import safe_url
from noetl_celery.store.db import current_revision, head_revision, migrate
from tests.support.workers import WorkerStartError

HEAD = head_revision()  # the revision `migrate` brings a store to


def test_a_worker_refuses_a_store_at_an_old_revision(fresh_postgres, worker_factory):
    migrate(fresh_postgres.url, "0002")  # a store the previous release left
    worker = worker_factory(env={"NOETL_DATABASE_URL": fresh_postgres.url}, start=False)
    with pytest.raises(WorkerStartError) as info:
        worker.start(timeout=60)
    assert "before it was ready" in str(info.value)
    log = worker.log_text()
    lines = [line for line in log.splitlines() if "is at revision 0002" in line]
    assert lines, worker.log_tail()
    assert (
        f"the event store at {safe_url(fresh_postgres.url)} is at revision 0002, this version needs {HEAD}: "
        "run `noetl-celery migrate`" in lines[0]
    )
    assert "Traceback" not in log and " ready." not in log
    assert current_revision(fresh_postgres.url) == "0002"  # a worker never changes a server's schema
