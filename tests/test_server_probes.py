"""`/health` and `/ready` of `noetl-celery server`, and what reads answer while the event store or
the broker is down: a real server process whose PostgreSQL is reached through a TCP proxy the
test cuts, and whose Redis broker is a redis-server the test stops and starts again."""

from __future__ import annotations

import time

import pytest
from sqlalchemy.engine import make_url

from tests.support.services import OwnRedis
from tests.support.tcp_proxy import TcpProxy
from tests.test_server import HELLO, Server, b64

pytestmark = pytest.mark.services
WAIT = 30  # seconds for the server to notice an outage or its end


def until(check, what: str, timeout: float = WAIT):
    deadline = time.monotonic() + timeout
    while True:
        value = check()
        if value is not None and value is not False:
            return value
        assert time.monotonic() < deadline, what
        time.sleep(0.2)


@pytest.fixture
def outage_server(tmp_path, migrated_postgres):
    url = make_url(migrated_postgres.url)
    redis = OwnRedis(aof=False)
    redis.start()
    with TcpProxy(url.host or "127.0.0.1", url.port or 5432) as proxy:
        store = url.set(host="127.0.0.1", port=proxy.port).render_as_string(hide_password=False)
        settings = {"NOETL_DATABASE_URL": store, "NOETL_BROKER_URL": redis.url}
        server = Server(tmp_path / "home", tmp_path / "server.log", settings=settings)
        try:
            yield server, proxy, redis
        finally:
            server.stop()
            redis.cleanup()


def unready(server: Server):
    """The /ready answer when it is 503, else None (a Response is falsy when not 2xx)."""
    answer = server.get("/ready")
    return answer if answer.status_code == 503 else None


def is_json_503(answer) -> bool:
    return answer.status_code == 503 and answer.headers["Content-Type"].startswith("application/json")


def test_ready_follows_the_store_and_the_broker_and_reads_answer_503_json(outage_server):
    server, proxy, redis = outage_server
    health, ready = server.get("/health"), server.get("/ready")
    assert health.status_code == 200 and health.json()["status"] == "ok"
    assert ready.status_code == 200, ready.text
    body = ready.json()
    assert body["status"] == "ready" and body["store"]["revision"] == body["store"]["head"]
    assert body["broker"]["ok"] is True
    submitted = server.post("/api/submit", {"content": b64(HELLO)})
    assert submitted.status_code == 200, submitted.text
    execution_id = submitted.json()["execution_id"]

    proxy.cut()  # the store is down
    ready = until(lambda: unready(server), "/ready stayed 200")
    assert ready.json()["status"] == "unready" and ready.json()["store"]["ok"] is False
    assert "event store" in ready.json()["store"]["error"]
    assert ready.json()["broker"]["ok"] is True
    assert server.get("/health").status_code == 200  # the process answers: no reason to restart it
    for path in (
        "/api/executions",
        f"/api/executions/{execution_id}",
        f"/api/executions/{execution_id}/status",
        f"/api/executions/{execution_id}/events",
        "/api/schedules",
    ):
        answer = server.get(path)
        assert is_json_503(answer), (path, answer.status_code, answer.text[:300])
        assert "event store" in answer.json()["detail"], answer.text
        assert answer.headers["Retry-After"]
    catalog = server.post("/api/catalog/list", {}, auth=False)
    assert is_json_503(catalog), catalog.text
    page = server.get("/")
    assert page.status_code == 503 and "event store" in page.text  # the dashboard's pages too

    proxy.heal()
    until(lambda: server.get("/ready").status_code == 200, "/ready did not come back with the store")
    assert server.get(f"/api/executions/{execution_id}").status_code == 200

    redis.stop()  # the broker is down
    ready = until(lambda: unready(server), "/ready stayed 200")
    assert ready.json()["broker"]["ok"] is False and ready.json()["store"]["ok"] is True
    assert server.get("/api/executions").status_code == 200  # reads need only the store
    refused = server.post("/api/submit", {"content": b64(HELLO)})
    assert is_json_503(refused), (refused.status_code, refused.text)
    redis.start()
    until(lambda: server.get("/ready").status_code == 200, "/ready did not come back with the broker")
