"""A worker reconnects within 10 s of its broker link coming back: a real Redis behind a TCP proxy
the test cuts for 30 s and heals (tests/support/tcp_proxy.py), real PostgreSQL, a real worker."""

from __future__ import annotations

import time
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

import pytest

from noetl_celery.runner import wait
from tests.support.engines import submit
from tests.support.tcp_proxy import TcpProxy

CHAIN = Path(__file__).resolve().parents[2] / "bench" / "playbooks" / "three_steps.yaml"
OUTAGE = 30.0
RECONNECT_WITHIN = 10.0


def through(url: str, port: int) -> str:
    parts = urlsplit(url)
    return urlunsplit(parts._replace(netloc=f"{parts.hostname}:{port}"))


@pytest.mark.slow
def test_a_worker_works_again_within_10_s_of_its_redis_link_healing(env, store_url, worker_factory):
    parts = urlsplit(env["NOETL_BROKER_URL"])
    proxy = TcpProxy(parts.hostname or "127.0.0.1", parts.port or 6379)
    try:
        worker = worker_factory(
            env={**env, "NOETL_BROKER_URL": through(env["NOETL_BROKER_URL"], proxy.port)}, concurrency=2
        )
        assert wait(store_url, submit(env, CHAIN), timeout=60)["status"] == "completed"
        proxy.cut()
        time.sleep(OUTAGE)
        proxy.heal()
        healed = time.monotonic()
        execution_id = submit(env, CHAIN)  # published straight to Redis, not through the proxy
        status = wait(store_url, execution_id, timeout=120)
        took = time.monotonic() - healed
        print(f"work resumed {took:.1f} s after a {OUTAGE:g} s cut of the worker's Redis link healed")
        assert status["status"] == "completed", status
        assert took < RECONNECT_WITHIN
        assert "Traceback" not in worker.log_text()  # an expected outage is a warning, not a crash
    finally:
        proxy.close()
