"""NOETL_LOG_FORMAT=json on a real prefork worker: every line is one JSON object, and each line an
attempt writes (the engine's, the playbook's own `logging`, what it writes to file descriptor 2)
names its execution, step, attempt, iteration and worker, with secrets masked. In text format the
playbook's own logging lines carry the execution too. The server's access log has timestamps;
beat's lines are JSON too."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time

import requests

from noetl_celery.runner import wait
from tests.support.engines import cli
from tests.support.services import stop_process
from tests.test_server import Server

SECRET = "json-log-secret-4711"
PLAYBOOK = f"""apiVersion: noetl.io/v10
kind: Playbook
metadata: {{name: json_logs}}
workload: {{items: [10, 20]}}
workflow:
  - step: start
    loop: {{in: "{{{{ items }}}}", iterator: x}}
    tool:
      kind: python
      args: {{x: "{{{{ iter.x }}}}"}}
      code: |
        import logging, os
        logging.getLogger("playbook.own").warning("own line for %s with {SECRET}", x)
        os.write(2, ("raw stderr for " + str(x) + " {SECRET}" + chr(10)).encode())
        result = x
"""


def _run(tmp_path, env, worker_factory, log_format: str):
    worker = worker_factory(env={**env, "NOETL_LOG_FORMAT": log_format, "NOETL_AUTH_LOG_TOKEN": SECRET}, concurrency=2)
    playbook = tmp_path / "json_logs.yaml"
    playbook.write_text(PLAYBOOK)
    proc = cli(["submit", str(playbook), "--json"], env)
    assert proc.returncode == 0, proc.stderr
    execution_id = json.loads(proc.stdout)["execution_id"]
    assert wait(env["NOETL_DATABASE_URL"], int(execution_id), timeout=120)["status"] == "completed"
    worker.wait_for_log("raw stderr for 20", timeout=30)
    worker.wait_for_log("raw stderr for 10", timeout=30)
    return worker, str(execution_id)


def test_json_lines_carry_the_attempt_and_mask_secrets(tmp_path, env, worker_factory):
    worker, execution_id = _run(tmp_path, env, worker_factory, "json")
    text = worker.log_text()
    assert SECRET not in text
    # every log line is JSON (Celery's start banner and its shutdown notice are printed, not logged)
    logged = text[text.index("\n{") :].splitlines()
    lines = [json.loads(line) for line in logged if line.strip() and "Warm shutdown" not in line]
    assert all({"timestamp", "level", "message"} <= set(line) for line in lines), lines[:3]
    own = [line for line in lines if line.get("logger") == "playbook.own"]
    raw = [line for line in lines if line["message"].startswith("raw stderr for")]
    assert len(own) == 2 and len(raw) == 2, (own, raw)
    for line in own + raw:
        assert line["execution_id"] == execution_id and line["step"] == "start", line
        assert line["attempt"] == 1 and line["iteration"] in (0, 1) and line["worker"] == worker.node, line
        assert "***" in line["message"]
    assert {line["iteration"] for line in own} == {0, 1}
    assert {line["message"] for line in own} == {"own line for 10 with ***", "own line for 20 with ***"}


def test_text_lines_of_the_playbooks_own_logging_name_the_execution(tmp_path, env, worker_factory):
    worker, execution_id = _run(tmp_path, env, worker_factory, "text")
    text = worker.log_text()
    assert SECRET not in text
    own = [line for line in text.splitlines() if "own line for" in line]
    assert len(own) == 2, own
    for line in own:
        assert re.search(rf"\[execution={execution_id} step=start attempt=1 iteration=[01]\]$", line), line


def test_the_servers_access_log_has_timestamps_in_both_formats(tmp_path):
    for style in ("text", "json"):
        server = Server(tmp_path / style, tmp_path / f"{style}.log", settings={"NOETL_LOG_FORMAT": style})
        try:
            assert requests.get(server.url + "/metrics", timeout=10).status_code == 200
            # the access line is written after the answer is sent: wait for it, not for a time
            deadline = time.monotonic() + 30
            while "GET /metrics" not in server.log_path.read_text() and time.monotonic() < deadline:
                time.sleep(0.05)
        finally:
            server.stop()
        access = [line for line in server.log_path.read_text().splitlines() if "GET /metrics" in line]
        assert access, server.log_path.read_text()[-2000:]
        if style == "json":
            line = json.loads(access[0])
            assert line["logger"] == "tornado.access" and re.match(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d", line["timestamp"])
        else:
            # the embedded worker's Celery format, or the server's own: a timestamp first
            assert re.match(r"\[?\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d+[: ]+INFO.* 200 GET /metrics", access[0]), access


def test_beat_logs_json_lines(tmp_path, env):
    log_path = tmp_path / "beat.log"
    beat_env = {k: v for k, v in os.environ.items() if not k.startswith("NOETL_")}
    beat_env.update({**env, "NOETL_LOG_FORMAT": "json", "NOETL_HOME": str(tmp_path)})
    with log_path.open("w") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "celery", "-A", "noetl_celery", "beat", "-l", "INFO"],
            env=beat_env,
            cwd=tmp_path,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        try:
            deadline = time.monotonic() + 60
            while "beat: Starting" not in log_path.read_text():
                assert proc.poll() is None and time.monotonic() < deadline, log_path.read_text()[-2000:]
                time.sleep(0.1)
        finally:
            stop_process(proc, timeout=15)
    logged = [line for line in log_path.read_text().splitlines() if line.startswith("{")]
    lines = [json.loads(line) for line in logged]
    assert any(line["logger"] == "celery.beat" and line["message"] == "beat: Starting..." for line in lines), lines
    assert all({"timestamp", "level", "logger", "message"} <= set(line) for line in lines)
