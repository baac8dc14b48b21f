"""What Flower shows of webhooks: a real worker whose delivery to a real receiver is refused sends
task-failed events for its `noetl.notify` tasks (Flower's FAILURE), and a task-succeeded one
once the receiver answers 200; the delivery state is in `noetl-celery status`."""

from __future__ import annotations

import time

from noetl_celery.runner import execution_status, wait
from tests.distributed.test_flower_truth import TaskEvents
from tests.support.engines import cli, submit
from tests.support.webhook_receiver import receiver

FAILING = """apiVersion: noetl.io/v10
kind: Playbook
metadata: {name: flower_hook}
workflow:
  - step: start
    tool: {kind: python, code: "raise ValueError('boom')"}
"""


def _wait(condition, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)


def test_refused_deliveries_are_failed_tasks_for_flower(tmp_path, env, migrated_postgres, worker_factory):
    # a store of its own: the sweep of a worker with NOETL_WEBHOOK_URL notifies every failure it finds
    store_url = migrated_postgres.url
    env = {**env, "NOETL_DATABASE_URL": store_url}
    playbook = tmp_path / "flower_hook.yaml"
    playbook.write_text(FAILING)
    with receiver({"/hook": [503, 503]}) as hooks:
        worker_env = {**env, "NOETL_WEBHOOK_URL": f"{hooks.url}/hook", "NOETL_SWEEP_INTERVAL": "0.5"}
        worker_factory(env=worker_env, concurrency=2, extra_args=["-E"])
        with TaskEvents(env["NOETL_BROKER_URL"]) as events:
            execution_id = submit(env, playbook)
            assert wait(store_url, execution_id, timeout=120)["status"] == "failed"
            _wait(lambda: [c["status"] for c in hooks.on("/hook")] == [503, 503, 200], 60, "two refusals, then 200")

            def notify_states() -> list[str]:
                tasks = events.tasks().values()
                return [t["type"] for t in tasks if t.get("name") == "noetl.notify" and t["type"] != "task-received"]

            # two failed deliveries; the delivery, and any duplicate the sweep sent meanwhile ("held"), succeed
            _wait(lambda: notify_states().count("task-failed") == 2 and "task-succeeded" in notify_states(), 30, "ends")
            assert notify_states().count("task-failed") == 2, events.tasks()
        failed = [e for e in events.by_type("task-failed") if "webhook of execution" in str(e.get("exception"))]
        assert len(failed) == 2 and "WebhookNotDelivered" in str(failed[0]["exception"]), failed
    assert execution_status(store_url, execution_id)["webhook"]["state"] == "delivered"
    shown = cli(["status", str(execution_id)], env)
    assert "webhook: delivered (3 attempts" in shown.stdout, shown.stdout + shown.stderr
