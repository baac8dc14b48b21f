"""Event rows name the worker as Flower does (its Celery node name) and the pool process that ran
the attempt (its pid, taken after the fork), so rows join with Flower's worker list."""

from __future__ import annotations

import json
from pathlib import Path

from noetl_celery.runner import execution_events, wait
from tests.support.engines import cli

LOOP = Path(__file__).resolve().parents[1] / "playbooks" / "loop_many.yaml"


def test_each_attempt_names_its_node_and_its_pool_process(env, store_url, worker_factory):
    node = worker_factory(env=env, concurrency=2, pool="prefork", name="ident@%h")
    proc = cli(["submit", str(LOOP), "--set", "n=16", "--set", "sleep=0.2", "--json"], env)
    assert proc.returncode == 0, proc.stderr
    execution_id = int(json.loads(proc.stdout)["execution_id"])
    assert wait(store_url, execution_id, timeout=120)["status"] == "completed"
    attempts = [e for e in execution_events(store_url, execution_id) if e["worker"]]
    assert len(attempts) >= 17  # start + 16 iterations
    assert {e["worker"] for e in attempts} == {node.node}
    pids = {e["meta"]["pid"] for e in attempts}
    assert node.pid not in pids  # the pool children ran them, not the parent that imported the app
    assert len(pids) == 2, pids  # both children, each with its own pid
