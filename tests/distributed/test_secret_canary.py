"""A canary credential, printed, returned, raised and echoed back, appears nowhere.

Real worker processes on Redis and a PostgreSQL store of this test's own, a loopback server that
echoes the bearer token back (as is, percent-encoded, base64, inside JSON) or rejects it, and
python steps that read the credentials file themselves. Afterwards no form of either canary (the
token, and a DSN password holding '#', '/', '@' and '%') is in `pg_dump` of the store, the
worker's log, any command Redis received while the playbooks ran, or the command line's output.
"""

from __future__ import annotations

import base64
import json
import re
import subprocess
import threading
from pathlib import Path
from urllib.parse import quote, quote_plus

import pytest
import redis

from noetl_celery.store.db import migrate
from tests.support.engines import cli
from tests.support.hostile_http import hostile_server
from tests.test_dashboard import Dashboard

TOKEN = "Tok/rel+0042==#@%canary"
DSN_PASSWORD = "Pw#rel-777/x@%y"
DSN = f"postgresql://app:{quote(DSN_PASSWORD, safe='')}@127.0.0.1:1/db"  # port 1: never reachable

ECHO = """apiVersion: noetl.io/v2
kind: Playbook
metadata: {name: canary_echo}
workflow:
  - step: start
    tool: {kind: http, url: "{{ api }}/echo", auth: canary}
    next: [{step: reader}]
  - step: reader
    tool:
      kind: python
      args: {path: "{{ creds_file }}", echoed: "{{ start }}"}
      code: |
        import base64, json, os
        from urllib.parse import quote
        entries = json.load(open(path))
        token, dsn = entries["canary"]["token"], entries["canary_dsn"]
        print("token", token, quote(token, safe=""), base64.b64encode(token.encode()).decode())
        result = {"token": token, "quoted": quote(token, safe=""), "json": json.dumps({"t": token}),
                  "b64": base64.b64encode(("user:" + token).encode()).decode(), "dsn": dsn,
                  "echoed": echoed,
                  "environ": {k: v for k, v in os.environ.items() if k.startswith("NOETL")}}
"""
REJECT = """apiVersion: noetl.io/v2
kind: Playbook
metadata: {name: canary_reject}
workflow:
  - step: start
    tool: {kind: http, url: "{{ api }}/reject", auth: canary}
"""
RAISE = """apiVersion: noetl.io/v2
kind: Playbook
metadata: {name: canary_raise}
workflow:
  - step: start
    tool:
      kind: python
      args: {path: "{{ creds_file }}"}
      code: |
        import json
        from urllib.parse import quote
        token = json.load(open(path))["canary"]["token"]
        raise ValueError("bad token " + token + " / " + quote(token, safe="") + " / " + json.dumps(token))
"""
ENCODED = """apiVersion: noetl.io/v2
kind: Playbook
metadata: {name: canary_encoded}
workflow:
  - step: start
    tool:
      kind: python
      args: {path: "{{ creds_file }}"}
      code: |
        import json, os, re, subprocess
        from urllib.parse import quote
        token = json.load(open(path))["canary"]["token"]
        lower = re.sub(r"%[0-9A-F]{2}", lambda m: m.group(0).lower(), quote(token, safe=""))
        spelled = {"lower": lower, "twice": quote(quote(token, safe=""), safe=""), "hex": token.encode().hex(),
                   "HEX": token.encode().hex().upper(), "slashed": json.dumps(token).replace("/", "\\\\/"),
                   "uescaped": "".join("\\\\u%04x" % ord(c) for c in token)}
        print("printed", *spelled.values())
        os.write(1, ("fd1-write " + " ".join(spelled.values()) + "\\n").encode())
        os.write(2, ("fd2-write " + token + " " + spelled["hex"] + "\\n").encode())
        subprocess.run(["sh", "-c", 'echo "subprocess-out $T $H"; echo "subprocess-err $T $L" >&2'],
                       env={"T": token, "H": spelled["hex"], "L": lower}, check=True)
        result = spelled
    next: [{step: fail}]
  - step: fail
    tool:
      kind: python
      args: {path: "{{ creds_file }}"}
      code: |
        import json, re
        from urllib.parse import quote
        token = json.load(open(path))["canary"]["token"]
        lower = re.sub(r"%[0-9A-F]{2}", lambda m: m.group(0).lower(), quote(token, safe=""))
        raise ValueError("hex " + token.encode().hex() + " lower " + lower
                         + " json " + json.dumps(token).replace("/", "\\\\/"))
"""
CONNECT = """apiVersion: noetl.io/v2
kind: Playbook
metadata: {name: canary_connect}
workflow:
  - step: start
    tool: {kind: postgres, auth: canary_dsn, query: "SELECT 1"}
"""


def lower_hex(text: str) -> str:
    return re.sub(r"%[0-9A-F]{2}", lambda m: m.group(0).lower(), text)


def forms(secret: str) -> set[str]:
    """Every spelling of `secret` that must not appear (written independently of the engine)."""
    out = {secret, quote(secret, safe=""), quote(secret), quote_plus(secret), json.dumps(secret)[1:-1]}
    out |= {lower_hex(quote(secret, safe="")), quote(quote(secret, safe=""), safe="")}  # %2f, %252F
    out |= {quote(lower_hex(quote(secret, safe="")), safe="")}  # %252f
    out |= {secret.encode().hex(), secret.encode().hex().upper()}
    out |= {json.dumps(secret)[1:-1].replace("/", "\\/")}
    out |= {"".join(f"\\u{ord(c):04x}" for c in secret), "".join(f"\\u{ord(c):04X}" for c in secret)}
    raw = secret.encode()
    for pad in range(3):
        for encode in (base64.b64encode, base64.urlsafe_b64encode):
            text = encode(b"\0" * pad + raw).decode().rstrip("=")
            out.add(text[(0, 2, 3)[pad] : len(text) - 1])  # the characters only the secret decides
    return out


CANARY_FORMS = forms(TOKEN) | forms(DSN_PASSWORD)


def leaks(text: str) -> list[str]:
    return sorted(f for f in CANARY_FORMS if f in text)


class RedisRecorder:
    """Every command the Redis server receives (MONITOR), recorded on a thread."""

    def __init__(self, url: str):
        self.client = redis.Redis.from_url(url)
        self.lines: list[str] = []
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        try:
            with self.client.monitor() as monitor:
                for command in monitor.listen():
                    self.lines.append(str(command.get("command", "")))
        except (OSError, ValueError, redis.ConnectionError):  # closed by __exit__
            return

    def __enter__(self) -> RedisRecorder:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.client.close()


@pytest.mark.timeout(600)
def test_canary_appears_nowhere(tmp_path: Path, fresh_postgres, redis_url, worker_factory):
    migrate(fresh_postgres.url)
    creds_file = tmp_path / "credentials.json"
    creds_file.write_text(json.dumps({"canary": {"type": "bearer", "token": TOKEN}, "canary_dsn": DSN}))
    secrets_env = {
        "NOETL_AUTH_CANARY": json.dumps({"type": "bearer", "token": TOKEN}),
        "NOETL_CREDENTIALS_FILE": str(creds_file),
    }
    store_env = {"NOETL_BROKER_URL": redis_url, "NOETL_DATABASE_URL": fresh_postgres.url}
    worker = worker_factory(env={**store_env, **secrets_env}, concurrency=2)
    outputs: list[str] = []
    statuses: dict[str, dict] = {}
    with hostile_server() as api, RedisRecorder(redis_url) as recorder:
        for name, text in (
            ("echo", ECHO),
            ("reject", REJECT),
            ("raise", RAISE),
            ("connect", CONNECT),
            ("encoded", ENCODED),
        ):
            playbook = tmp_path / f"{name}.yaml"
            playbook.write_text(text)
            proc = cli(
                [
                    "submit",
                    "--wait",
                    "--json",
                    "--timeout",
                    "120",
                    str(playbook),
                    "--set",
                    f"api={api}",
                    "--set",
                    f"creds_file={creds_file}",
                ],
                store_env,
            )
            outputs += [proc.stdout, proc.stderr]
            statuses[name] = json.loads(proc.stdout)
            execution_id = str(statuses[name]["execution_id"])
            for args in (
                ["status", "--json", execution_id],
                ["events", "--json", execution_id],
                ["events", execution_id],
            ):
                shown = cli(args, store_env)
                outputs += [shown.stdout, shown.stderr]
        redis_text = "\n".join(recorder.lines)
    dashboard = Dashboard(store_env, tmp_path / "dashboard.log")
    try:
        pages = ["/"]
        for status in statuses.values():
            x = status["execution_id"]
            pages += [f"/executions/{x}", f"/executions/{x}/live", f"/api/executions/{x}"]
        shown = [dashboard.get(page) for page in pages]
    finally:
        dashboard.stop()
    assert all(r.status_code == 200 for r in shown), [(r.url, r.status_code) for r in shown]
    assert "canary_encoded" in shown[0].text

    # the playbooks did what a leak needs: the token was sent, echoed, read, printed and raised
    assert statuses["echo"]["status"] == "completed", statuses["echo"]
    reader = statuses["echo"]["results"]["reader"]
    assert reader["token"] == "***" and reader["quoted"] == "***" and reader["json"] == '{"t": "***"}'
    assert reader["echoed"]["data"]["raw"] == "***" and reader["echoed"]["data"]["b64"] == "***"
    assert reader["echoed"]["headers"]["x-echo"] == "***"
    assert not [
        k
        for k in reader["environ"]
        if k.startswith("NOETL_AUTH_") or k in ("NOETL_DATABASE_URL", "NOETL_BROKER_URL", "NOETL_CREDENTIALS_FILE")
    ], reader["environ"]
    assert statuses["reject"]["status"] == "failed" and statuses["reject"]["error"]["kind"] == "auth"
    assert statuses["raise"]["status"] == "failed" and "bad token ***" in statuses["raise"]["error"]["message"]
    assert statuses["connect"]["status"] == "failed"
    encoded = statuses["encoded"]
    assert encoded["status"] == "failed" and encoded["failed_step"] == "fail", encoded
    spelled = encoded["results"]["start"]
    assert spelled == {
        "lower": "***",
        "twice": "***",
        "hex": "***",
        "HEX": "***",
        "slashed": '"***"',
        "uescaped": "***",
    }
    assert 'hex *** lower *** json "***"' in encoded["error"]["message"], encoded["error"]
    log = worker.log_text()
    for written in ('fd1-write *** *** *** *** "***" ***', "fd2-write *** ***", "subprocess-out *** ***"):
        assert written in log, written  # what the code wrote to fd 1/2 itself reached the log, masked
    assert "subprocess-err *** ***" in log
    assert redis_text, "MONITOR recorded nothing"

    dump = subprocess.run(
        ["pg_dump", "--data-only", fresh_postgres.dsn], capture_output=True, text=True, timeout=120, check=True
    ).stdout
    assert "canary_echo" in dump and "***" in dump  # the dump holds the executions, masked
    assert leaks(dump) == [], "in the store"
    assert leaks(log) == [], "in the worker log"
    assert leaks(redis_text) == [], "in a Redis command"
    assert leaks("\n".join(outputs)) == [], "in the command line's output"
    assert leaks("\n".join(r.text for r in shown)) == [], "on the dashboard"
