"""Shared fixtures. The logic lives in tests/support (services.py, workers.py).

Session fixtures: redis_url, amqp_url, postgres_server_url, postgres_url, pg_dsn.
Function fixtures: sqlite_url, fresh_postgres, migrated_postgres, either_store, broker, broker_url, worker_factory.
Brokers: a test runs on Redis unless it asks for `broker` by indirect parametrization, e.g.
``@pytest.mark.parametrize("broker", BROKERS, indirect=True)`` (tests.support.services.BROKERS).
Options: --run-slow (tests marked `slow` run only with it or with env CI=true).
"""

from __future__ import annotations

import functools
import http.server
import os
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support import services as svc
from tests.support.corpus import CONFORMANCE_MARK, ConformanceTally, uses_corpus
from tests.support.loopback import serve
from tests.support.workers import WorkerGroup

MARKERS = {
    "services": "needs a real Redis or RabbitMQ and PostgreSQL (found or started by the test session)",
    "slow": "long-running correctness runs",
    CONFORMANCE_MARK: "a conformance case: runs a file of the NoETL corpus (given by collection)",
    "smoke": "an end-to-end test that also runs as a subprocess on the embedded and distributed deployments",
    "real_workers": "needs real time or parallel workers: never runs on the in-process harness",
}
SERVICE_FIXTURES = {
    "redis_url",
    "redis_server_url",
    "amqp_url",
    "amqp_server_url",
    "broker_url",
    "postgres_server_url",
    "postgres_url",
    "pg_dsn",
    "fresh_postgres",
    "migrated_postgres",
    "worker_factory",
    "mysql_url",  # the cursor drivers' and tools' servers (tests/test_cursor_*.py, test_nats_tool.py)
    "nats_url",
    "bucket",
    "token_server",
    "pg",  # test_tools.py: the postgres tool against the machine's PostgreSQL
}


# Test modules are imported with their asserts rewritten by pytest, which caches the result as
# bytecode unless writing bytecode is off (PYTHONDONTWRITEBYTECODE): then each process of the
# session (four with -n 4) rewrote and compiled every test module again, about 6 CPU-seconds each.
sys.dont_write_bytecode = False


def pytest_addoption(parser):
    parser.addoption(
        "--run-slow", action="store_true", default=False, help="run tests marked slow (always run when env CI=true)"
    )


def pytest_configure(config):
    for name, doc in MARKERS.items():
        config.addinivalue_line("markers", f"{name}: {doc}")


_conformance = ConformanceTally()


def pytest_collection_modifyitems(config, items):
    run_slow = config.getoption("--run-slow") or svc.ci_mode()
    skip_slow = pytest.mark.skip(reason="slow: give --run-slow (or CI=true) to run")
    for item in items:
        if uses_corpus(item):
            item.add_marker(CONFORMANCE_MARK)
        if SERVICE_FIXTURES.intersection(getattr(item, "fixturenames", ())):
            item.add_marker("services")
        if "slow" in item.keywords and not run_slow:
            item.add_marker(skip_slow)
    items[:] = dealt(items, int(os.environ.get("PYTEST_XDIST_WORKER_COUNT") or 1))


def _start_order(item) -> int:
    """0: slow, 1: with real workers, 2: the rest (seconds or less each)."""
    if "slow" in item.keywords:
        return 0
    if "distributed" in item.nodeid.split("/")[:2] or "worker_factory" in getattr(item, "fixturenames", ()):
        return 1
    return 2


def dealt(items: list, processes: int) -> list:
    """The items in the order that lets `processes` pytest-xdist processes (`-n 4 --dist
    worksteal`) end together. Worksteal first gives each process a contiguous share of the list,
    then an idle process takes the back half of the longest queue left. So each share is made to
    hold as many long tests as the others, at its front, and short tests behind them for the
    idle processes to take. Within each rank, the files' own order."""
    ordered = sorted(items, key=_start_order)  # stable
    if processes <= 1:
        return ordered
    long = [item for item in ordered if _start_order(item) < 2]
    short = ordered[len(long) :]
    shares: list[list] = [long[k::processes] for k in range(processes)]
    left = len(items)
    for k, share in enumerate(shares):  # the sizes worksteal cuts: what is left over the processes left
        size = left // (processes - k)
        left -= size
        take = max(size - len(share), 0)
        share.extend(short[:take])
        del short[:take]
    shares[-1].extend(short)
    return [item for share in shares for item in share]


def pytest_runtest_logreport(report):
    _conformance.add(report)


def pytest_terminal_summary(terminalreporter):
    if _conformance.nodeids:
        terminalreporter.section("conformance")
        for line in _conformance.lines():
            terminalreporter.write_line(line)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    group = getattr(item, "_noetl_workers", None)
    if group is not None and report.failed:
        report.sections.extend(group.log_sections())


# ------------------------------------------------------------------ services


@pytest.fixture(scope="session")
def services():
    """The session's `tests.support.services.Services` (finds or starts the servers)."""
    with svc.Services() as s:
        yield s


def _get(fn):
    try:
        return fn()
    except svc.ServiceUnavailable as exc:
        svc.unavailable(str(exc))


@pytest.fixture(scope="session")
def redis_server_url(services) -> str:
    """Server-level Redis URL (no database index)."""
    return _get(services.redis_server_url)


@pytest.fixture(scope="session")
def redis_url(services) -> str:
    """Redis URL with this session's own database index (flushed at start and end)."""
    return _get(services.redis_url)


@pytest.fixture(scope="session")
def amqp_server_url(services) -> str:
    """AMQP URL of the RabbitMQ server (NOETL_TEST_AMQP_URL, else the local one), its own vhost."""
    return _get(services.amqp_server_url)


@pytest.fixture(scope="session")
def amqp_url(services) -> str:
    """AMQP URL of this session's own RabbitMQ virtual host (deleted at the end)."""
    return _get(services.amqp_url)


@pytest.fixture
def broker(request) -> str:
    """The broker kind of this test: "redis", or what an indirect parametrization gives."""
    kind = getattr(request, "param", "redis")
    if kind not in svc.BROKERS:
        raise ValueError(f"unknown broker {kind!r}: one of {svc.BROKERS}")
    return kind


@pytest.fixture
def broker_url(request, broker) -> str:
    """URL of this session's place on the test's broker (`redis_url` or `amqp_url`)."""
    return request.getfixturevalue("amqp_url" if broker == "amqp" else "redis_url")


@pytest.fixture(scope="session")
def postgres_server_url(services) -> str:
    """Server-level libpq URL (postgresql://user@host:port/postgres)."""
    return _get(services.postgres_server_url)


@pytest.fixture(scope="session")
def postgres_database(services) -> svc.FreshDatabase:
    return _get(services.postgres_database)


@pytest.fixture(scope="session")
def postgres_url(postgres_database) -> str:
    """SQLAlchemy URL (postgresql+psycopg2://) of this session's fresh database."""
    return postgres_database.url


@pytest.fixture(scope="session")
def pg_dsn(postgres_database) -> str:
    """The same database as a libpq key/value DSN (for the postgres tool)."""
    return postgres_database.dsn


@pytest.fixture
def fresh_postgres(postgres_server_url):
    """A database of this test's own (FreshDatabase: .url, .dsn, .name), dropped after it."""
    with svc.fresh_database(postgres_server_url) as db:
        yield db


@pytest.fixture
def migrated_postgres(services):
    """A database of this test's own at the schema's head (FreshDatabase), dropped after it: a
    copy of the session's migrated template, not a migration of its own."""
    template = _get(services.migrated_template)
    with svc.fresh_database(template.server_url, template=template.name) as db:
        yield db


@pytest.fixture
def sqlite_url(tmp_path) -> str:
    """SQLAlchemy URL of a SQLite file in this test's tmp dir."""
    return f"sqlite:///{tmp_path / 'noetl.sqlite'}"


@pytest.fixture(params=["sqlite", pytest.param("postgresql", marks=pytest.mark.services)])
def either_store(request, tmp_path) -> str:
    """An empty event store's URL, once on SQLite and once on PostgreSQL (a fresh database,
    migrated: only `migrate` changes a server's schema)."""
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 'noetl.sqlite'}"
    return request.getfixturevalue("migrated_postgres").url


# ------------------------------------------------------------------ workers


@pytest.fixture
def worker_factory(request, tmp_path, broker_url):
    """Start real worker processes: ``worker_factory(app="noetl_celery", env={...}, concurrency=4,
    pool="prefork", queues=(...), name=None, start=True, timeout=30)`` -> WorkerProcess.

    NOETL_BROKER_URL defaults to `broker_url` (Redis unless the test asks for another); every worker is stopped at teardown and the tail
    of its log is added to the report of a failed test.
    """
    log_dir = tmp_path / "workers"
    log_dir.mkdir()
    group = WorkerGroup(log_dir, default_env={"NOETL_BROKER_URL": broker_url})
    request.node._noetl_workers = group
    yield group
    errors = group.stop_all()
    if errors:
        for name, text in group.log_sections():
            print(f"----- {name}\n{text}")
        pytest.fail("could not stop workers: " + "; ".join(errors), pytrace=False)


@pytest.fixture
def script_server(tmp_path: Path) -> Iterator[str]:
    """A real HTTP server on loopback serving tmp_path/www."""
    www = tmp_path / "www"
    www.mkdir()
    (www / "job.py").write_text("result = {'from': 'http'}\n")
    (www / "create.sql").write_text("SELECT 'http' AS source\n")
    with serve(functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(www))) as url:
        yield url
