"""The test support code works against real servers and real worker processes."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time

import pytest

from tests.support import services as svc
from tests.support.echo_app import make_app
from tests.support.workers import REPO_ROOT, WorkerProcess, group_members, process_alive

# ------------------------------------------------------------------ helpers without servers


def test_unavailable_skips_or_fails_in_ci(monkeypatch):
    monkeypatch.delenv("CI", raising=False)
    with pytest.raises(pytest.skip.Exception):
        svc.unavailable("nothing")
    monkeypatch.setenv("CI", "true")
    with pytest.raises(pytest.fail.Exception):
        svc.unavailable("nothing")


def test_url_helpers():
    assert svc.redis_db_url("redis://:pw@h:6380/0", 7) == "redis://:pw@h:6380/7"
    assert svc.redis_base_url("redis://h:1/3") == "redis://h:1"
    url = "postgresql+psycopg2://u:p%40ss@h:5433/postgres?sslmode=disable"
    assert svc.sqlalchemy_url(url, "x") == "postgresql+psycopg2://u:p%40ss@h:5433/x?sslmode=disable"
    assert svc.libpq_url(url, "x") == "postgresql://u:p%40ss@h:5433/x?sslmode=disable"
    assert svc.libpq_dsn(url, "x") == "host=h port=5433 user=u password=p@ss dbname=x sslmode=disable"
    assert svc.libpq_dsn("postgresql://u:a%20b'c@h/d") == r"host=h user=u password='a b\'c' dbname=d"


def test_sqlite_url(sqlite_url, tmp_path):
    import sqlalchemy as sa

    assert sqlite_url.startswith("sqlite:////")
    engine = sa.create_engine(sqlite_url)
    with engine.begin() as conn:
        conn.execute(sa.text("CREATE TABLE t (x INTEGER)"))
    engine.dispose()
    assert (tmp_path / "noetl.sqlite").exists()


# ------------------------------------------------------------------ Redis


def test_redis_ping_set_get(redis_url):
    client = svc.redis_client(redis_url)
    try:
        assert client.ping()
        client.set("noetl:test:k", "v")
        assert client.get("noetl:test:k") == b"v"
        db = int(redis_url.rsplit("/", 1)[1])
        assert 1 <= db <= 15
        assert client.get(svc.REDIS_CLAIM_KEY) is not None  # this session's claim
    finally:
        client.close()


def test_redis_db_claims_are_exclusive(redis_server_url, redis_url):
    mine = int(redis_url.rsplit("/", 1)[1])
    with svc.claim_redis_db(redis_server_url) as other:
        assert other.db != mine
        client = svc.redis_client(other.url)
        client.set("left-behind", 1)
    assert client.get("left-behind") is None  # released: flushed
    assert client.get(svc.REDIS_CLAIM_KEY) is None
    client.close()


def test_a_redis_database_holding_data_the_tests_did_not_write_is_never_claimed():
    if not svc.find_redis_server():
        svc.unavailable("redis-server is not installed")
    with svc.RedisServer().start() as srv:  # a server of this test's own: no shared data at risk
        foreign = svc.redis_client(svc.redis_db_url(srv.url, 1))
        foreign.set("someone:else", "keep me")
        with svc.claim_redis_db(srv.url, dbs=[1, 2]) as claim:
            assert claim.db == 2
        assert foreign.get("someone:else") == b"keep me"
        with pytest.raises(svc.ServiceUnavailable, match="did not write"):
            svc.claim_redis_db(srv.url, dbs=[1])
        # what a crashed session left (its claim expired) is the suite's own: claimed again
        left = svc.claim_redis_db(srv.url, dbs=[2])
        svc.redis_client(left.url).set("leftover", 1)
        svc.redis_client(left.url).delete(svc.REDIS_CLAIM_KEY)
        assert svc.claim_redis_db(srv.url, dbs=[2]).db == 2
        foreign.close()


def test_throwaway_redis_answers_then_is_gone():
    if not svc.find_redis_server():
        svc.unavailable("redis-server is not installed")
    srv = svc.RedisServer().start()
    try:
        assert srv.running()
        client = svc.redis_client(srv.url)
        assert client.ping()
        client.set("a", "1")
        assert client.get("a") == b"1"
        client.close()
        pid = srv.proc.pid
    finally:
        srv.stop()
    assert not srv.running()
    assert not process_alive(pid)
    assert not svc.redis_answers(srv.url)
    assert not srv.workdir.exists()


def test_configured_redis_url_wins(monkeypatch):
    if not svc.find_redis_server():
        svc.unavailable("redis-server is not installed")
    with svc.RedisServer() as srv:
        monkeypatch.setenv(svc.REDIS_URL_ENV, srv.url + "/0")
        with svc.Services() as s:
            assert s.redis_server_url() == srv.url
            assert s.sources["redis"] == "configured"
            assert s.redis_url().startswith(srv.url + "/")
        monkeypatch.setenv(svc.REDIS_URL_ENV, f"redis://127.0.0.1:{svc.free_port()}")
        with svc.Services() as s, pytest.raises(svc.ServiceUnavailable):
            s.redis_server_url()


def test_services_fall_back_to_throwaway_servers(monkeypatch):
    """(c): with nothing configured and the local defaults silent, servers are started."""
    if not svc.find_redis_server() or svc.find_postgres_bindir() is None:
        svc.unavailable("redis-server or PostgreSQL binaries are not installed")
    monkeypatch.delenv(svc.REDIS_URL_ENV, raising=False)
    monkeypatch.delenv(svc.POSTGRES_URL_ENV, raising=False)
    monkeypatch.setattr(svc, "DEFAULT_REDIS_URL", f"redis://127.0.0.1:{svc.free_port()}")
    monkeypatch.setattr(svc, "DEFAULT_POSTGRES_URL", f"postgresql://postgres@127.0.0.1:{svc.free_port()}/postgres")
    with svc.Services() as s:
        redis_url = s.redis_url()
        db = s.postgres_database()
        assert s.sources == {"redis": "throw-away", "postgres": "throw-away"}
        assert redis_url.endswith("/1")  # a private server: the first index is free
        with svc.pg_connect(db.url) as conn, conn.cursor() as cur:
            cur.execute("SELECT current_database()")
            assert cur.fetchone() == (db.name,)
        conn.close()
    assert not svc.redis_answers(s.redis_server_url())
    assert not svc.postgres_answers(s.postgres_server_url())


# ------------------------------------------------------------------ PostgreSQL


def test_postgres_fresh_database(postgres_url, pg_dsn, postgres_server_url):
    import psycopg2
    import sqlalchemy as sa

    assert postgres_url.startswith("postgresql+psycopg2://")
    name = sa.engine.make_url(postgres_url).database
    assert name.startswith(f"noetl_test_{os.getpid()}_")
    assert f"dbname={name}" in pg_dsn

    engine = sa.create_engine(postgres_url)
    with engine.begin() as conn:
        conn.execute(sa.text("CREATE TABLE t (id serial PRIMARY KEY, v text)"))
        conn.execute(sa.text("INSERT INTO t (v) VALUES ('x')"))
    engine.dispose()
    with psycopg2.connect(pg_dsn) as conn, conn.cursor() as cur:
        cur.execute("SELECT current_database(), count(*) FROM t")
        assert cur.fetchone() == (name, 1)
    conn.close()


def test_fresh_database_is_dropped_even_with_open_connections(postgres_server_url):
    import sqlalchemy as sa

    db = svc.fresh_database(postgres_server_url)
    engine = sa.create_engine(db.url)
    conn = engine.connect()  # left open on purpose
    conn.execute(sa.text("SELECT 1"))
    db.drop()
    with svc.pg_connect(postgres_server_url) as admin, admin.cursor() as cur:
        cur.execute("SELECT count(*) FROM pg_database WHERE datname = %s", (db.name,))
        assert cur.fetchone() == (0,)
    admin.close()
    engine.dispose()


def test_fresh_postgres_fixture(fresh_postgres, postgres_url):
    assert fresh_postgres.url != postgres_url
    with svc.pg_connect(fresh_postgres.url) as conn, conn.cursor() as cur:
        cur.execute("SELECT current_database()")
        assert cur.fetchone() == (fresh_postgres.name,)
    conn.close()


def test_throwaway_postgres_answers_then_is_gone():  # ~1 s here, so not marked slow
    if svc.find_postgres_bindir() is None:
        svc.unavailable("PostgreSQL server binaries are not installed")
    t0 = time.monotonic()
    pg = svc.PostgresCluster().start()
    try:
        assert pg.running()
        assert time.monotonic() - t0 < 60
        with svc.fresh_database(pg.url) as db:
            with svc.pg_connect(db.url) as conn, conn.cursor() as cur:
                cur.execute("CREATE TABLE t (x int)")
                cur.execute("INSERT INTO t VALUES (1)")
                cur.execute("SELECT count(*) FROM t")
                assert cur.fetchone() == (1,)
            conn.close()
        pid = pg.proc.pid
    finally:
        pg.stop()
    assert not pg.running()
    assert not process_alive(pid)
    assert not svc.postgres_answers(pg.url)
    assert not pg.workdir.exists()


# ------------------------------------------------------------------ worker processes


def test_worker_process_runs_task_then_kill_takes_the_group(worker_factory, redis_url):
    worker = worker_factory(
        "tests.support.echo_app", concurrency=2, queues=("echo.test",), env={"NOETL_TASK_QUEUE": "echo.test"}
    )
    assert worker.running()
    assert worker.node == f"{worker.name.split('@')[0]}@{socket.gethostname()}"
    assert f"{worker.node} ready." in worker.log_text()

    client = make_app(redis_url, queue="echo.test")
    try:
        assert client.send_task("echo.add", args=(2, 3)).get(timeout=30) == 5
        assert client.send_task("echo.echo", args=({"a": [1, 2]},)).get(timeout=30) == {"a": [1, 2]}
        child = client.send_task("echo.pid").get(timeout=30)
    finally:
        client.close()

    pgid = worker.pgid
    members = group_members(pgid)
    assert worker.pid in members and child in members and len(members) >= 3  # main + 2 children
    assert os.getpgid(child) == pgid

    worker.kill()
    assert not worker.running()
    assert worker.returncode == -9
    assert group_members(pgid) == []
    assert not process_alive(child)


def test_worker_process_stop_is_warm_and_context_manager(redis_url, tmp_path):
    with WorkerProcess(
        "tests.support.echo_app",
        env={"NOETL_BROKER_URL": redis_url},
        concurrency=1,
        pool="solo",
        queues=("echo.cm",),
        log_dir=tmp_path,
    ) as w:
        assert w.running()
        pgid = w.pgid
    assert not w.running()
    assert w.returncode == 0
    assert group_members(pgid) == []
    assert "ready." in w.log_text()


def test_worker_start_failure_reports_log(tmp_path, redis_url):
    w = WorkerProcess("tests.support.no_such_module", env={"NOETL_BROKER_URL": redis_url}, log_dir=tmp_path)
    with pytest.raises(Exception) as info:
        w.start(timeout=30)
    assert "no_such_module" in str(info.value)
    assert not w.running()


# ------------------------------------------------------------------ conftest behaviour


INNER_TESTS = """
import pytest

@pytest.mark.slow
def test_slow():
    pass

def test_marked(request, redis_url):
    assert "services" in request.node.keywords

def test_worker_fails(worker_factory):
    worker_factory("tests.support.echo_app", concurrency=1, pool="solo", queues=("inner.q",))
    assert False, "boom"
"""


def _inner_pytest(tmp_path, *args, ci=None):
    (tmp_path / "conftest.py").write_text("from tests.conftest import *  # noqa\n")
    (tmp_path / "pytest.ini").write_text("[pytest]\naddopts = -p no:celery -p no:cacheprovider\n")
    (tmp_path / "test_inner.py").write_text(INNER_TESTS)
    env = {k: v for k, v in os.environ.items() if k not in ("CI", "PYTEST_ADDOPTS")}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO_ROOT), env.get("PYTHONPATH")) if p)
    if ci is not None:
        env["CI"] = ci
    res = subprocess.run(
        [sys.executable, "-m", "pytest", "-rA", *args],
        cwd=tmp_path,
        env=env,
        check=False,
        capture_output=True,
        text=True,
        timeout=300,
    )
    return res.stdout + res.stderr


def test_conftest_slow_option_markers_and_worker_logs_on_failure(tmp_path, redis_url):
    out = _inner_pytest(tmp_path)
    assert "1 failed, 1 passed, 1 skipped" in out, out
    assert "give --run-slow" in out, out
    # the failing test's report carries the worker's warnings and errors and its last lines
    assert "worker w" in out and "-- warnings and errors:" in out and "-- last lines:" in out, out
    assert " ready." in out, out

    out = _inner_pytest(tmp_path, "--run-slow", "-k", "slow")
    assert "1 passed, 2 deselected" in out, out
    out = _inner_pytest(tmp_path, "-k", "slow", ci="true")
    assert "1 passed, 2 deselected" in out, out


def test_the_corpus_is_built_from_a_clone_at_the_commits_the_index_names(tmp_path):
    import subprocess

    from tests.support import corpus

    clone = tmp_path / "noetl"
    fixture = clone / "tests" / "fixtures" / "playbooks" / "hello.yaml"
    fixture.parent.mkdir(parents=True)
    fixture.write_text("name: at-the-commit\n")

    def git(*args: str) -> str:
        return subprocess.run(
            ["git", "-C", str(clone), *args],
            check=True,
            capture_output=True,
            text=True,
            env={
                "GIT_AUTHOR_NAME": "t",
                "GIT_AUTHOR_EMAIL": "t@t",
                "GIT_COMMITTER_NAME": "t",
                "GIT_COMMITTER_EMAIL": "t@t",
                "PATH": os.environ["PATH"],
            },
        ).stdout.strip()

    git("init", "-q")
    git("add", "-A")
    git("commit", "-qm", "fixtures")
    commit = git("rev-parse", "HEAD")[:12]
    fixture.write_text("name: changed-later\n")  # the working tree differs: the commit is what counts
    index = tmp_path / "INDEX.tsv"
    index.write_text(
        "era\tfile\tsource_repo@commit\tsource_path\texercises\tservices_needed\n"
        f"v1\tv1/hello.yaml\tnoetl/noetl@{commit}\ttests/fixtures/playbooks/hello.yaml\thello\tnone\n"
        "v1\tv1/gone.yaml\tnoetl/noetl@{0}\ttests/fixtures/playbooks/gone.yaml\tx\tnone\n".format(commit)
        + "c\tc/other.yaml\tnoetl/e2e@abc\tfixtures/x.yaml\tx\tnone\n"
    )
    written, missing = corpus.build({"noetl/noetl": clone}, tmp_path / "out", index)
    assert written == 1
    assert (tmp_path / "out" / "v1" / "hello.yaml").read_text() == "name: at-the-commit\n"
    assert (tmp_path / "out" / "INDEX.tsv").read_text() == index.read_text()
    assert len(missing) == 2 and "gone.yaml" in missing[0] and "no clone of noetl/e2e" in missing[1]


def test_amqp_url_helpers():
    assert svc.amqp_vhost_of("amqp://guest:guest@h:5672//") == "/"
    assert svc.amqp_vhost_of("amqp://h:5672") == "/"
    assert svc.amqp_vhost_of("amqp://h/noetl_test_1_ab") == "noetl_test_1_ab"
    assert svc.amqp_vhost_url("amqp://u:p@h:5672//", "a/b") == "amqp://u:p@h:5672/a%2Fb"
    assert svc.amqp_vhost_of(svc.amqp_vhost_url("amqp://h//", "a/b")) == "a/b"


def test_the_session_has_a_rabbitmq_vhost_of_its_own(amqp_server_url, amqp_url):
    vhost = svc.amqp_vhost_of(amqp_url)
    assert vhost.startswith(svc.AMQP_VHOST_PREFIX) and vhost != svc.amqp_vhost_of(amqp_server_url)
    assert svc.amqp_answers(amqp_url)
    with svc.create_amqp_vhost(amqp_server_url) as other:
        assert svc.amqp_vhost_of(other.url) not in (vhost, "/")
        assert svc.amqp_answers(other.url)
        names = {e["name"] for e in other.admin.list()}
        assert {vhost, svc.amqp_vhost_of(other.url)} <= names
    assert svc.amqp_vhost_of(other.url) not in {e["name"] for e in other.admin.list()}  # deleted
    assert not svc.amqp_answers(other.url)


def test_only_a_dead_session_s_vhost_is_stale():
    import json
    import socket

    dead = json.dumps({"host": socket.gethostname(), "pid": 2**22 + 7})
    assert svc._vhost_is_stale({"name": "noetl_test_1_ab", "description": dead})
    assert not svc._vhost_is_stale(
        {"name": "noetl_test_1_ab", "description": json.dumps({"host": socket.gethostname(), "pid": os.getpid()})}
    )
    assert not svc._vhost_is_stale(
        {"name": "noetl_test_1_ab", "description": json.dumps({"host": "elsewhere", "pid": 2**22 + 7})}
    )
    assert not svc._vhost_is_stale({"name": "someone_else", "description": dead})  # not a session's name
    assert not svc._vhost_is_stale({"name": "noetl_test_1_ab", "description": "a developer's vhost"})
