"""Failure webhooks: `noetl-celery server` (its embedded worker and sweeper) calls a real HTTP
receiver on loopback once per failed or cancelled execution, with its id, playbook, failed step
and masked error; a refused delivery is tried again with backoff, and a delivered one never."""

from __future__ import annotations

import hashlib
import hmac
import os
import subprocess
import sys
import time

import pytest

from noetl_celery.observe import webhooks
from tests.support.webhook_receiver import receiver
from tests.test_server import REPO_ROOT, SLOW_LOOP, Server

SECRET = "s3cr3t-api-token-value"  # Server's NOETL_AUTH_API_TOKEN: a configured secret

FAILING = f"""apiVersion: noetl.io/v10
kind: Playbook
metadata: {{name: hook_fails, path: tests/hook_fails}}
workflow:
  - step: start
    tool: {{kind: python, code: "result = 1"}}
    next:
      arcs: [{{step: boom}}]
  - step: boom
    tool: {{kind: python, code: "raise ValueError('bad token {SECRET}')"}}
"""


def wait_for(condition, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


def test_backoff_doubles_up_to_its_cap():
    assert [webhooks.backoff(n) for n in (1, 2, 3, 4)] == [1.0, 2.0, 4.0, 8.0]
    assert webhooks.backoff(30) == webhooks.BACKOFF_MAX


def test_a_failed_and_a_cancelled_execution_are_each_notified_once(tmp_path):
    # the global URL refuses its first delivery; the cancelled playbook names its own URL
    with receiver({"/global": [503]}) as hooks:
        slow = SLOW_LOOP.replace(
            "workload: {n: 400, sleep: 0.2}",
            f"workload: {{n: 400, sleep: 0.2}}\nexecutor: {{spec: {{webhook: '{hooks.url}/own'}}}}",
        )
        server = Server(
            tmp_path / "home",
            tmp_path / "server.log",
            settings={"NOETL_WEBHOOK_URL": f"{hooks.url}/global", "NOETL_SWEEP_INTERVAL": "0.5"},
        )
        try:
            assert server.register(FAILING).status_code == 200
            assert server.register(slow).status_code == 200
            failed = server.post("/api/execute", {"path": "tests/hook_fails"}).json()["execution_id"]
            running = server.post("/api/execute", {"path": "tests/api_slow_loop"}).json()["execution_id"]
            assert server.wait_end(failed)["status"] == "failed"
            server.wait_started(running, "work")
            assert server.post(f"/api/executions/{running}/cancel", {"reason": "enough"}).status_code == 200

            wait_for(lambda: any(c["status"] == 200 for c in hooks.on("/global")), 30, "the global delivery")
            wait_for(lambda: len(hooks.on("/own")) == 1, 30, "the playbook's own webhook")
            # several sweeps later: nothing more was sent
            time.sleep(3 * 0.5 + 1.5)
        finally:
            assert server.stop() == 0, server.log_path.read_text()[-3000:]

    first, second = hooks.on("/global")  # exactly two: one refused, then the delivery
    assert (first["status"], second["status"]) == (503, 200)
    assert first["body"]["attempt"] == 1 and second["body"]["attempt"] == 2
    assert second["at"] - first["at"] >= webhooks.backoff(1) * 0.9  # tried again after its backoff
    body = second["body"]
    assert body["execution_id"] == str(failed) and body["playbook"] == "hook_fails"
    assert (body["status"], body["failed_step"], body["path"]) == ("failed", "boom", "tests/hook_fails")
    assert "ValueError" in str(body["error"]) and SECRET not in str(body) and "***" in str(body["error"])
    assert second["headers"]["Idempotency-Key"] == f"noetl-execution-{failed}"

    [own] = hooks.on("/own")
    assert own["status"] == 200
    assert own["body"]["execution_id"] == str(running) and own["body"]["status"] == "cancelled"
    assert own["body"]["error"]["message"] == "enough"
    assert len(hooks.calls) == 3
    log = server.log_path.read_text()
    assert SECRET not in log


def _ended(url: str, execution_id: int, status: str, webhook: str | None = None, parent: int | None = None) -> None:
    from noetl_celery.store import repo
    from noetl_celery.store.db import ensure_schema, transaction

    ensure_schema(url)
    plan = {"name": f"p{execution_id}", "webhook": webhook}
    with transaction(url) as conn:
        repo.create_execution(conn, execution_id=execution_id, plan=plan, workload={}, parent_execution_id=parent)
        repo.finish_execution(conn, execution_id, status, error={"message": "x"}, failed_step="s")


class Answer:
    def __init__(self, status_code: int):
        self.status_code = status_code


def test_the_scan_the_lease_and_the_retries_in_the_store(sqlite_url):
    from noetl_celery.config import settings as noetl_settings

    _ended(sqlite_url, 1, "failed")
    _ended(sqlite_url, 2, "cancelled", webhook="http://127.0.0.1:9/own")
    _ended(sqlite_url, 3, "completed", webhook="http://127.0.0.1:9/own")
    _ended(sqlite_url, 4, "failed", webhook="http://127.0.0.1:9/own", parent=2)  # a child: its parent's business
    without = noetl_settings.load({"NOETL_DATABASE_URL": sqlite_url})
    with_url = noetl_settings.load({"NOETL_DATABASE_URL": sqlite_url, "NOETL_WEBHOOK_URL": "http://127.0.0.1:9/g"})
    assert webhooks.pending(without) == [2]  # no setting: only a playbook's own webhook
    assert sorted(webhooks.pending(with_url)) == [1, 2]

    calls: list[str] = []

    def refused(url, **_):
        calls.append(url)
        raise ConnectionError("refused")

    assert webhooks.deliver(with_url, 1, post=refused) == ("retry", 1.0)
    assert webhooks.deliver(with_url, 1, post=refused) == ("held", None)  # not due before its backoff
    assert webhooks.pending(with_url) == [2]  # 1 waits for its next try
    assert webhooks.deliver(with_url, 2, post=lambda url, **_: (calls.append(url), Answer(200))[1]) == (
        "delivered",
        None,
    )
    assert webhooks.deliver(with_url, 2, post=refused) == ("held", None)  # delivered: never again
    assert calls == ["http://127.0.0.1:9/g", "http://127.0.0.1:9/own"]
    assert webhooks.deliver(with_url, 3, post=refused) == ("not_chosen", None)  # completed: not chosen by default


def test_a_playbooks_own_webhook_is_a_string_in_executor_spec():
    from noetl_celery.compiler import compile_playbook
    from noetl_celery.core.errors import PlaybookError

    text = FAILING.replace("workflow:", "executor: {spec: {webhook: 'https://hooks.example/x'}}\nworkflow:", 1)
    assert compile_playbook("p.yaml", text=text).webhook == "https://hooks.example/x"
    assert compile_playbook("p.yaml", text=FAILING).webhook is None
    with pytest.raises(PlaybookError, match="executor.spec.webhook"):
        compile_playbook("p.yaml", text=text.replace("'https://hooks.example/x'", "5"))


def test_a_webhook_mapping_names_its_url_events_and_secret_and_bad_ones_are_refused():
    from noetl_celery.compiler import compile_playbook
    from noetl_celery.core.errors import PlaybookError

    def spec(hook: str) -> str:
        return FAILING.replace("workflow:", f"executor: {{spec: {{webhook: {hook}}}}}\nworkflow:", 1)

    plan = compile_playbook("p.yaml", text=spec("{url: 'https://h/x', events: [completed, failed], secret: k}"))
    assert (plan.webhook, plan.webhook_events, plan.webhook_secret) == ("https://h/x", ["completed", "failed"], "k")
    for bad, said in (
        ("{url: 'https://h/x', events: [finished]}", "executor.spec.webhook.events"),
        ("{url: 'https://h/x', events: []}", "executor.spec.webhook.events"),
        ("{events: [failed]}", "executor.spec.webhook.url"),
        ("{url: 'https://h/x', secret: 5}", "executor.spec.webhook.secret"),
    ):
        with pytest.raises(PlaybookError, match=said):
            compile_playbook("p.yaml", text=spec(bad))
    # an unknown key is a warning (NoETL ignores it), a problem only where templates render strictly
    warnings: list = []
    compile_playbook("p.yaml", text=spec("{url: 'https://h/x', retries: 3}"), warnings=warnings)
    assert any("retries" in str(w) for w in warnings)


@pytest.mark.services
def test_the_scan_reads_the_last_days_ends_not_every_failure_kept(migrated_postgres):
    """With a history of failed executions, the sweep's webhook scan goes through the partial
    index of recent top-level failures (0008_indexes), not through every failure ever kept."""
    from sqlalchemy import event, text

    from noetl_celery.config import settings as noetl_settings
    from noetl_celery.store.db import get_engine, transaction

    url = migrated_postgres.url
    with transaction(url) as conn:  # 20,000 executions of the last 60 days, one in five failed
        conn.execute(
            text(
                "INSERT INTO noetl_execution (execution_id, depth, playbook_name, status, plan, workload, pending, "
                "state_version, created_at, updated_at, finished_at, epoch) "
                "SELECT g, 0, 'p', CASE WHEN g % 5 = 0 THEN 'failed' ELSE 'completed' END, '{}', '{}', 0, 0, "
                "now() - interval '60 days' + g * interval '4 minutes', now(), "
                "now() - interval '60 days' + g * interval '4 minutes' + interval '1 minute', 0 "
                "FROM generate_series(1, 20000) g"
            )
        )
        conn.execute(text("ANALYZE noetl_execution"))
    _ended(url, 20_001, "failed")  # ended now
    sent: list[tuple[str, object]] = []
    engine = get_engine(url)

    def keep(_conn, _cursor, statement, parameters, _context, _executemany):
        if "FROM noetl_execution" in statement and "finished_at" in statement:
            sent.append((statement, parameters))

    event.listen(engine, "before_cursor_execute", keep)
    try:
        settings = noetl_settings.load({"NOETL_DATABASE_URL": url, "NOETL_WEBHOOK_URL": "http://127.0.0.1:9/g"})
        assert webhooks.pending(settings) == [20_001]
    finally:
        event.remove(engine, "before_cursor_execute", keep)
    assert len(sent) == 2  # the failures and cancels, then the completions a playbook asked for
    statement, parameters = sent[0]
    with transaction(url) as conn:
        cursor = conn.connection.dbapi_connection.cursor()
        cursor.execute("EXPLAIN " + statement, parameters)
        plan = "\n".join(row[0] for row in cursor.fetchall())
    assert "ix_noetl_execution_ended" in plan, plan


HOOK_KEY = "hmac-key-for-the-receiver"  # the credential `hook_key` (NOETL_AUTH_HOOK_KEY): a configured secret


def _chosen(name: str, code: str, url: str, events: str) -> str:
    return f"""apiVersion: noetl.io/v10
kind: Playbook
metadata: {{name: {name}, path: tests/{name}}}
executor: {{spec: {{webhook: {{url: '{url}', events: {events}, secret: hook_key}}}}}}
workflow:
  - step: start
    tool: {{kind: python, code: "{code}"}}
"""


def test_signed_webhooks_of_the_events_a_playbook_chose_and_the_delivery_state_in_status(tmp_path):
    with receiver({"/global": [503] * 20}) as hooks:
        server = Server(
            tmp_path / "home",
            tmp_path / "server.log",
            settings={
                "NOETL_WEBHOOK_URL": f"{hooks.url}/global",
                "NOETL_SWEEP_INTERVAL": "0.5",
                "NOETL_AUTH_HOOK_KEY": HOOK_KEY,
            },
        )
        try:
            done_playbook = _chosen("hook_done", "result = 1", f"{hooks.url}/done", "[completed]")
            skipped_playbook = _chosen("hook_skip", "raise ValueError('no')", f"{hooks.url}/skip", "[completed]")
            for text in (done_playbook, skipped_playbook, FAILING):
                assert server.register(text).status_code == 200
            done = server.post("/api/execute", {"path": "tests/hook_done"}).json()["execution_id"]
            skipped = server.post("/api/execute", {"path": "tests/hook_skip"}).json()["execution_id"]
            refused = server.post("/api/execute", {"path": "tests/hook_fails"}).json()["execution_id"]
            assert server.wait_end(done)["status"] == "completed"
            assert server.wait_end(skipped)["status"] == "failed"
            assert server.wait_end(refused)["status"] == "failed"
            wait_for(lambda: len(hooks.on("/done")) == 1, 30, "the completion's webhook")
            wait_for(lambda: len(hooks.on("/global")) >= 2, 30, "two refused deliveries")
            status = _status(tmp_path / "home", refused)
            skipped_status = _status(tmp_path / "home", skipped)
            time.sleep(1.5)  # several sweeps: nothing for the failure its playbook did not choose
        finally:
            server.stop()

    assert hooks.on("/skip") == []
    call = hooks.on("/done")[0]
    assert call["body"]["event"] == "completed" and call["body"]["execution_id"] == str(done)
    assert call["headers"]["X-Noetl-Event"] == "completed"
    stamp, mac = dict(part.split("=", 1) for part in call["headers"]["X-Noetl-Signature"].split(",")).values()
    expected = hmac.new(HOOK_KEY.encode(), stamp.encode() + b"." + call["raw"], hashlib.sha256).hexdigest()
    assert hmac.compare_digest(mac, expected)
    assert webhooks.signature(HOOK_KEY, call["raw"], int(stamp)) == call["headers"]["X-Noetl-Signature"]
    assert "X-Noetl-Signature" not in hooks.on("/global")[0]["headers"]  # no NOETL_WEBHOOK_SECRET: unsigned
    assert "webhook: retrying (" in status and "last error: HTTP 503" in status, status
    assert "webhook: not_chosen" in skipped_status, skipped_status
    assert HOOK_KEY not in (tmp_path / "server.log").read_text()


def _status(home, execution_id) -> str:
    env = {k: v for k, v in os.environ.items() if not k.startswith("NOETL_")}
    env.update({"NOETL_HOME": str(home), "PYTHONPATH": str(REPO_ROOT)})
    done = subprocess.run(
        [sys.executable, "-m", "noetl_celery.cli", "status", str(execution_id)],
        capture_output=True,
        text=True,
        env=env,
        cwd=REPO_ROOT,
        timeout=60,
    )
    return done.stdout + done.stderr


def test_a_failed_delivery_ends_its_task_as_a_failure(sqlite_url, monkeypatch):
    """What Flower shows: the `noetl.notify` task of a refused delivery fails (its state is FAILURE)."""
    from noetl_celery import app as app_module
    from noetl_celery.config import settings as noetl_settings
    from noetl_celery.core.errors import WebhookNotDelivered

    with receiver({"/refuse": [503]}) as hooks:
        _ended(sqlite_url, 7, "failed", webhook=f"{hooks.url}/refuse")
        settings = noetl_settings.load({"NOETL_DATABASE_URL": sqlite_url})
        monkeypatch.setattr(app_module, "current_settings", lambda: settings)
        monkeypatch.setattr(app_module, "enqueue_notifications", lambda ids, countdown=0.0: None)
        failed = app_module.notify.apply(kwargs={"execution_id": 7})
        assert failed.state == "FAILURE" and isinstance(failed.result, WebhookNotDelivered)
        webhooks_state = _notification(sqlite_url, 7)
        assert webhooks_state["attempts"] == 1 and webhooks_state["last_error"] == "HTTP 503"
        monkeypatch.setattr(webhooks, "BACKOFF_BASE", 0.0)
        _clear_next_try(sqlite_url, 7)
        delivered = app_module.notify.apply(kwargs={"execution_id": 7})
        assert delivered.state == "SUCCESS" and delivered.result == "delivered"
    assert [c["status"] for c in hooks.on("/refuse")] == [503, 200]


def _notification(url: str, execution_id: int) -> dict:
    from noetl_celery.store import schedules as store
    from noetl_celery.store.db import transaction

    with transaction(url) as conn:
        return store.notification(conn, execution_id) or {}


def _clear_next_try(url: str, execution_id: int) -> None:
    from sqlalchemy import update

    from noetl_celery.store.db import transaction
    from noetl_celery.store.schedules import NOTIFICATIONS

    with transaction(url) as conn:
        conn.execute(update(NOTIFICATIONS).where(NOTIFICATIONS.c.execution_id == execution_id).values(next_at=None))
