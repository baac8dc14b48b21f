"""End-to-end fixtures. Every test runs on the in-process harness (tests/support/harness.py: the
DSL's semantics, in seconds); those marked `smoke` (one or more per feature file) or
`real_workers` (their assertions need real waits or parallel workers) also run through the real
command line on both deployments a user has: embedded (`noetl-celery run`) and distributed
(`noetl-celery submit --wait` on Redis + PostgreSQL with two worker processes). A
`real_workers` test does not run on the harness."""

from __future__ import annotations

import json

import pytest

from noetl_celery.store.db import migrate
from tests.support.engines import DistributedEngine, EmbeddedEngine, InProcessEngine
from tests.support.mockapi import start_mock_api
from tests.support.workers import WorkerGroup

API_TOKEN = "tok-3f9c1e-very-secret-value"  # must never appear in any event row
PG_PASSWORD_MARKER = "pg-credential-name-only"
TEST_SECRET = "sec-7d41-value-read-by-the-secrets-tool"  # must never appear in any event row


SUBPROCESS_MODES = ("embedded", "distributed")


def pytest_collection_modifyitems(config, items):
    """Each e2e test on the deployments its markers ask for (see the module doc)."""
    kept, dropped = [], []
    for item in items:
        mode = getattr(item, "callspec", None) and item.callspec.params.get("engine")
        if mode == "inprocess":
            wanted = item.get_closest_marker("real_workers") is None
        elif mode in SUBPROCESS_MODES:
            wanted = bool(item.get_closest_marker("smoke") or item.get_closest_marker("real_workers"))
        else:
            wanted = True
        (kept if wanted else dropped).append(item)
    if dropped:
        config.hook.pytest_deselected(items=dropped)
        items[:] = kept


@pytest.fixture(scope="session")
def mock_api():
    with start_mock_api() as server:
        yield server


@pytest.fixture(scope="session")
def credential_env(pg_dsn) -> dict[str, str]:
    """Credentials by name, as a deployment would provide them to workers."""
    return {
        "NOETL_AUTH_PG_LOCAL": pg_dsn,
        "NOETL_AUTH_PG_K8S": pg_dsn,
        "NOETL_AUTH_PG_TEST": pg_dsn,
        "NOETL_AUTH_API_TOKEN": json.dumps({"type": "bearer", "token": API_TOKEN}),
        "NOETL_AUTH_TEST_SECRET": TEST_SECRET,
    }


@pytest.fixture(scope="module", params=["inprocess", "embedded", "distributed"])
def engine(request, tmp_path_factory, credential_env):
    if request.param == "inprocess":
        yield InProcessEngine(tmp_path_factory.mktemp("noetl-home"), credential_env)
        return
    if request.param == "embedded":
        yield EmbeddedEngine(tmp_path_factory.mktemp("noetl-home"), credential_env)
        return
    redis_url = request.getfixturevalue("redis_url")
    postgres_url = request.getfixturevalue("postgres_url")
    migrate(postgres_url)
    group = WorkerGroup(
        tmp_path_factory.mktemp("workers"),
        default_env={"NOETL_BROKER_URL": redis_url, "NOETL_DATABASE_URL": postgres_url, **credential_env},
    )
    # two worker instances, as a deployment scales out: a run's tasks are spread over both
    group(concurrency=2, name="e2e-a@%h")
    group(concurrency=2, name="e2e-b@%h")
    try:
        yield DistributedEngine(redis_url, postgres_url, credential_env)
    finally:
        errors = group.stop_all()
        if errors:
            for name, text in group.log_sections():
                print(f"----- {name}\n{text}")
