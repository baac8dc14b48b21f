"""Sub-playbooks never hold a worker: 100 children in flight on two workers of concurrency 2."""

from __future__ import annotations

import json
from pathlib import Path

from noetl_celery.runner import execution_status, wait
from tests.support.engines import cli

PARENT = Path(__file__).resolve().parents[1] / "playbooks" / "sub" / "parent.yaml"
RUN_TIMEOUT = 600  # seconds, on a loaded machine


def test_a_loop_of_100_sub_playbooks_at_max_in_flight_100_completes_on_four_worker_slots(
    env, store_url, worker_factory
):
    for name in ("sub-a@%h", "sub-b@%h"):
        worker_factory(env=env, concurrency=2, name=name)
    proc = cli(["submit", str(PARENT), "--json", "--set", "n=100"], env)
    assert proc.returncode == 0, proc.stderr
    execution_id = int(json.loads(proc.stdout)["execution_id"])
    status = wait(store_url, execution_id, timeout=RUN_TIMEOUT)
    assert status["status"] == "completed", status.get("error")
    assert status["results"]["done"] == {"values": [2 * i for i in range(100)]}
    children = status["children"]
    assert len(children) == 100 and {c["status"] for c in children} == {"completed"}
    assert all(
        execution_status(store_url, c["execution_id"])["parent_execution_id"] == execution_id for c in children[:5]
    )
