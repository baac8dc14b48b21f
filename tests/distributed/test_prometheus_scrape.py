"""Debian's real `prometheus` server scrapes a real `noetl-celery server` (the store's series) and a
real prefork worker (its own NOETL_METRICS_PORT) on loopback while a loop fails, and its HTTP API
shows the failed-executions counter rise and the worker's failed attempts counted."""

from __future__ import annotations

import shutil
import subprocess
import time
from pathlib import Path

import pytest
import requests

from tests.support.playbooks import range_loop
from tests.support.services import free_port, stop_process
from tests.test_server import Server

PLAYBOOK = "metrics_failing_loop"
FAILING_LOOP = range_loop(
    PLAYBOOK,
    path=f"tests/{PLAYBOOK}",
    workload="{n: 6}",
    max_in_flight=3,
    tool="""      kind: python
      args: {x: "{{ iter.x }}"}
      code: |
        import time
        if x == 4:
            time.sleep(3)  # a few scrapes see the execution running before it fails
            raise ValueError("item 4 is bad")
        result = x
""",
)
SCRAPE_INTERVAL = "1s"


def _prometheus_config(path: Path, server_port: int, worker_port: int) -> None:
    path.write_text(
        f"""global:
  scrape_interval: {SCRAPE_INTERVAL}
  evaluation_interval: {SCRAPE_INTERVAL}
rule_files: [{Path(__file__).resolve().parents[2] / "docker/prometheus/alerts.yml"}]
scrape_configs:
  - job_name: noetl-server
    static_configs: [{{targets: ["127.0.0.1:{server_port}"]}}]
  - job_name: noetl-worker
    static_configs: [{{targets: ["127.0.0.1:{worker_port}"]}}]
"""
    )


class Prometheus:
    """`prometheus` on its own free loopback port, with its storage in a temporary directory."""

    def __init__(self, tmp_path: Path, server_port: int, worker_port: int):
        binary = shutil.which("prometheus")
        if binary is None:
            pytest.fail("the `prometheus` binary is missing: apt-get install prometheus (.ci/run installs it)")
        config = tmp_path / "prometheus.yml"
        _prometheus_config(config, server_port, worker_port)
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = tmp_path / "prometheus.log"
        self.log = self.log_path.open("w")
        self.proc = subprocess.Popen(
            [
                binary,
                f"--config.file={config}",
                f"--storage.tsdb.path={tmp_path / 'tsdb'}",
                f"--web.listen-address=127.0.0.1:{self.port}",
            ],
            stdout=self.log,
            stderr=subprocess.STDOUT,
        )
        self.wait(lambda: self._ready(), 60, "prometheus to be ready")

    def _ready(self) -> bool:
        try:
            return requests.get(self.url + "/-/ready", timeout=2).status_code == 200
        except requests.ConnectionError:
            return False

    def query(self, expr: str) -> list[dict]:
        answer = requests.get(self.url + "/api/v1/query", params={"query": expr}, timeout=10).json()
        assert answer["status"] == "success", answer
        return answer["data"]["result"]

    def value(self, expr: str) -> float | None:
        found = self.query(expr)
        return float(found[0]["value"][1]) if found else None

    def targets_up(self) -> dict[str, float]:
        return {r["metric"]["job"]: float(r["value"][1]) for r in self.query("up")}

    def wait(self, condition, timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        while not condition():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise AssertionError(f"timed out waiting for {what}: {self.log_path.read_text()[-3000:]}")
            time.sleep(0.2)

    def stop(self) -> None:
        stop_process(self.proc, timeout=15)
        self.log.close()


@pytest.mark.services
def test_prometheus_sees_the_failed_executions_counter_rise(tmp_path, env, worker_factory):
    worker_port = free_port()
    worker_factory(
        env={**env, "NOETL_METRICS_PORT": str(worker_port), "NOETL_METRICS_HOST": "127.0.0.1"}, concurrency=2
    )
    server = Server(tmp_path / "home", tmp_path / "server.log", settings=env)
    prometheus = Prometheus(tmp_path, server.port, worker_port)
    failed = f'noetl_executions_ended_total{{playbook="{PLAYBOOK}",status="failed"}}'
    try:
        prometheus.wait(lambda: prometheus.targets_up() == {"noetl-server": 1.0, "noetl-worker": 1.0}, 30, "both up")
        before = prometheus.value(failed) or 0.0

        assert server.register(FAILING_LOOP).status_code == 200
        execution_id = server.post("/api/execute", {"path": f"tests/{PLAYBOOK}"}).json()["execution_id"]
        assert server.wait_end(int(execution_id))["status"] == "failed"

        prometheus.wait(lambda: (prometheus.value(failed) or 0.0) >= before + 1, 30, "the failed counter to rise")
        # the rise as Prometheus's own functions see it: from 0 (the series exists from the start) to 1
        assert (prometheus.value(f"max_over_time({failed}[5m])") or 0) >= 1
        assert prometheus.value(f"min_over_time({failed}[5m])") == before
        # the worker's own series: the failed attempt of item 4, by tool kind
        errors = 'sum(noetl_attempts_total{job="noetl-worker",outcome="error",tool="python"})'
        prometheus.wait(lambda: (prometheus.value(errors) or 0.0) >= 1, 30, "the worker's failed attempts")
        assert (prometheus.value('sum(noetl_attempts_total{job="noetl-worker",outcome="ok"})') or 0) >= 2
        assert (prometheus.value('sum(noetl_decision_seconds_count{job="noetl-worker"})') or 0) >= 3
        assert prometheus.value('noetl_store_up{job="noetl-server"}') == 1.0
        assert prometheus.value('noetl_broker_up{job="noetl-server"}') == 1.0
        queues = {r["metric"]["queue"] for r in prometheus.query('noetl_queue_depth{job="noetl-server"}')}
        assert queues == {"noetl_tasks", "noetl_events"} or len(queues) == 2, queues
        # the example alert rule fires on it
        prometheus.wait(
            lambda: any(
                r["metric"].get("alertname") == "NoetlExecutionFailed" and r["metric"].get("playbook") == PLAYBOOK
                for r in prometheus.query("ALERTS")
            ),
            30,
            "the NoetlExecutionFailed alert",
        )
    finally:
        prometheus.stop()
        assert server.stop() == 0, server.log_path.read_text()[-3000:]
