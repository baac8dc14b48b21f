"""`noetl-celery server`: NoETL's REST API over real HTTP on loopback, on the embedded default (the
server's own embedded worker runs what it starts), its authentication and bad bodies, the OpenAPI
document, and NoETL's own client (`pip install noetl==5.3.2`) driving it unchanged."""

from __future__ import annotations

import base64
import fcntl
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import requests
from sqlalchemy import bindparam, text

from tests.support.playbooks import range_loop
from tests.support.services import free_port, stop_process

REPO_ROOT = Path(__file__).resolve().parents[1]
TOKEN = "server-token-for-tests"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
START_TIMEOUT = 60  # seconds for the server to answer /health
END_TIMEOUT = 60  # seconds for an execution to end
NOETL_CLIENT = "noetl==5.3.2"  # NoETL's own client, from PyPI

HELLO = """apiVersion: noetl.io/v10
kind: Playbook
metadata: {name: api_hello, path: tests/api_hello}
workload: {message: hello, nested: {a: 1, b: 2}}
workflow:
  - step: start
    tool: {kind: python, args: {message: "{{ message }}", nested: "{{ nested }}"}, code: "result = {'message': message, 'nested': nested}"}
"""

# a loop that runs for a while (the cancel tests stop it)
SLOW_LOOP = range_loop(
    "api_slow_loop",
    path="tests/api_slow_loop",
    workload="{n: 400, sleep: 0.2}",
    max_in_flight=2,
    tool="""      kind: python
      args: {x: "{{ iter.x }}", pause: "{{ sleep }}"}
      code: |
        import time
        time.sleep(pause)
        result = x
""",
)


class Server:
    """`noetl-celery server` (or `dashboard`) as a real process on a free loopback port."""

    def __init__(
        self,
        home: Path,
        log: Path,
        command: str = "server",
        token: str | None = TOKEN,
        settings: dict[str, str] | None = None,
    ):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        env = {k: v for k, v in os.environ.items() if not k.startswith("NOETL_") or k.startswith("NOETL_TEST_")}
        env["NOETL_HOME"] = str(home)
        env["PYTHONUNBUFFERED"] = "1"  # its "listening" line is in the log once it answers
        env.update(settings or {})  # NOETL_BROKER_URL, NOETL_DATABASE_URL: workers run what it starts
        env["NOETL_AUTH_API_TOKEN"] = "s3cr3t-api-token-value"  # a configured secret: masked in answers
        if token:
            env["NOETL_DASHBOARD_TOKEN"] = token
        self.log_path = log
        self.log = log.open("w")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "noetl_celery.cli", command, "--port", str(self.port)],
            env=env,
            cwd=REPO_ROOT,
            stdout=self.log,
            stderr=subprocess.STDOUT,
        )
        deadline = time.monotonic() + START_TIMEOUT
        while time.monotonic() < deadline:
            try:
                if requests.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except requests.ConnectionError:
                pass
            if self.proc.poll() is not None:
                break
            time.sleep(0.1)
        self.stop()
        raise AssertionError(f"{command} did not answer on {self.url}: {log.read_text()}")

    def get(self, path: str, **kwargs) -> requests.Response:
        return requests.get(self.url + path, timeout=30, **kwargs)

    def post(self, path: str, body: object = None, auth: bool = True, **kwargs) -> requests.Response:
        headers = {**(AUTH if auth else {}), **kwargs.pop("headers", {})}
        return requests.post(self.url + path, json=body, headers=headers, timeout=30, **kwargs)

    def register(self, text: str) -> requests.Response:
        return self.post("/api/catalog/register", {"content": b64(text), "resource_type": "Playbook"})

    def wait_end(self, execution_id: int) -> dict:
        deadline = time.monotonic() + END_TIMEOUT
        while time.monotonic() < deadline:
            status = self.get(f"/api/executions/{execution_id}/status").json()
            if status["status"] != "running":
                return status
            time.sleep(0.1)
        raise AssertionError(f"execution {execution_id} still running after {END_TIMEOUT} s")

    def wait_started(self, execution_id: int, step: str) -> None:
        """Until `step` has a recorded run (the execution is under way)."""
        deadline = time.monotonic() + END_TIMEOUT
        while time.monotonic() < deadline:
            if step in self.get(f"/api/executions/{execution_id}").json()["steps"]:
                return
            time.sleep(0.1)
        raise AssertionError(f"{step} of {execution_id} never started")

    def stop(self) -> int:
        """SIGTERM, as a service manager stops it; returns its exit code."""
        stop_process(self.proc, timeout=15)
        self.log.close()
        return self.proc.returncode


def b64(text: str) -> str:
    return base64.b64encode(text.encode()).decode()


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = tmp_path_factory.mktemp("server")
    s = Server(root / "home", root / "server.log")
    yield s
    # SIGTERM stops it as Ctrl-C does: the embedded worker ends its attempts, the exit is clean
    assert s.stop() == 0, s.log_path.read_text()[-3000:]


WRITES = [
    "/api/catalog/register",
    "/api/execute",
    "/api/executions/1/cancel",
    "/api/executions/1/rerun",
    "/api/executions/cleanup",
    "/api/executions/1/resume",
    "/api/validate",
    "/api/compile",
    "/api/submit",
]


def test_health_and_the_openapi_document(server):
    from openapi_spec_validator import validate

    from noetl_celery.dashboard import api
    from noetl_celery.dashboard.openapi import expand

    assert f"server (embedded worker) on {server.url}/" in server.log_path.read_text()
    health = server.get("/health")
    assert health.status_code == 200 and health.json()["status"] == "ok"
    assert health.json()["runs_executions"] is True  # the embedded worker of `server`
    document = server.get("/api/openapi.json").json()
    validate(document)  # raises on an invalid OpenAPI 3.1 document
    # every route of the API is described, each of its methods (generated from api.api_routes)
    described = set(document["paths"])
    for pattern, handler in api.api_routes():
        if handler is api.NotFound:
            continue
        names = [n for n in ("get", "post", "delete") if handler.implements(n.upper())]
        assert names, pattern
        for path, _ in expand(pattern, ["execution_id", "n"] if "attempts" in pattern else ["name"] * 2):
            path = path.replace("{name}", "{execution_id}") if "executions" in path else path
            assert path in described, (pattern, path)
            assert set(names) == set(document["paths"][path]), (path, names)
    assert "/api/executions/{execution_id}" in described
    for path in WRITES:
        templated = path.replace("/1/", "/{execution_id}/")
        assert document["paths"][templated]["post"]["security"] == [{"bearer": []}], path


@pytest.mark.parametrize("path", WRITES)
def test_every_write_needs_the_bearer_token(server, path):
    def catalog() -> list:
        return server.post("/api/catalog/list", {"resource_type": "Playbook"}, auth=False).json()["entries"]

    def executions() -> set[str]:
        return set(re.findall(r"/executions/(\d+)", server.get("/").text))

    before = catalog(), executions()
    for headers in (
        {},
        {"Authorization": "Bearer wrong"},
        # the right token, but as Basic credentials (a browser replays those by itself): refused
        {"Authorization": "Basic " + base64.b64encode(f"ops:{TOKEN}".encode()).decode()},
    ):
        answer = server.post(path, {"content": b64(HELLO), "path": "tests/api_hello"}, auth=False, headers=headers)
        assert answer.status_code == 401, (headers, answer.text)
        assert "Bearer" in answer.json()["detail"]
        assert answer.headers["WWW-Authenticate"].startswith("Bearer")
    assert (catalog(), executions()) == before  # nothing was registered or started


BAD_BODIES = [
    ("/api/catalog/register", "not json", "body"),
    ("/api/catalog/register", [1, 2], "body"),
    ("/api/catalog/register", {}, "content"),
    ("/api/catalog/register", {"content": "%%% not base64"}, "content"),
    ("/api/catalog/register", {"content": b64("a: [unclosed")}, "content"),
    ("/api/catalog/register", {"content": b64(HELLO), "resource_type": "Dataset"}, "resource_type"),
    ("/api/catalog/list", {"resource_type": 7}, "resource_type"),
    ("/api/execute", {}, "path"),
    ("/api/execute", {"path": 12}, "path"),
    ("/api/execute", {"path": "tests/api_hello", "workload": [1]}, "workload"),
    ("/api/execute", {"path": "tests/api_hello", "payload": "x=1"}, "payload"),
    ("/api/execute", {"path": "tests/api_hello", "resource_kind": "dataset"}, "resource_kind"),
    ("/api/execute", {"path": "tests/api_hello", "version": 7}, "version"),
    ("/api/execute", {"path": "tests/api_hello", "workload": {"a": 1, "a.b": 2}}, "workload"),
    ("/api/executions/1/cancel", {"cascade": "yes"}, "cascade"),
    ("/api/executions/1/cancel", {"reason": ["a"]}, "reason"),
    ("/api/executions/1/rerun", {"workload": "k=v"}, "workload"),
    ("/api/executions/cleanup", {"older_than_minutes": "5"}, "older_than_minutes"),
    ("/api/executions/cleanup", {"older_than_minutes": True}, "older_than_minutes"),
    ("/api/executions/cleanup", {"older_than_minutes": -1}, "older_than_minutes"),
    ("/api/executions/cleanup", {"dry_run": "true"}, "dry_run"),
    ("/api/validate", {"content": 5}, "content"),
    ("/api/compile", {"content": b64(HELLO), "workload": 1}, "workload"),
    ("/api/submit", {"workload": {}}, "content"),
    ("/api/executions/1/resume", [], "body"),
]


@pytest.mark.parametrize(("path", "body", "field"), BAD_BODIES)
def test_a_bad_body_gets_400_naming_the_field(server, path, body, field):
    if body == "not json":
        answer = requests.post(server.url + path, data="{not json", headers=AUTH, timeout=30)
    else:
        answer = server.post(path, body)
    assert answer.status_code == 400, answer.text
    error = answer.json()
    assert error["field"] == field
    assert error["detail"].startswith(f"{field}:") or field == "content", error


def test_bad_query_parameters_get_400(server):
    for path, name in (
        ("/api/executions/1?page=0", "page"),
        ("/api/executions/1?page_size=5000", "page_size"),
        ("/api/executions/1?page=x", "page"),
        ("/api/executions/1?page=72057594037927935&page_size=387", "page"),  # an offset past 64 bits
        ("/api/executions?status=done", "status"),
        ("/api/executions?limit=0", "limit"),
        ("/api/executions/1/events?limit=100000", "limit"),
        ("/api/executions/1/events?after=x", "after"),
    ):
        answer = server.get(path)
        assert answer.status_code == 400, (path, answer.text)
        assert name in answer.json()["detail"]


FLAKY = """apiVersion: noetl.io/v10
kind: Playbook
metadata: {name: api_flaky}
workload: {marker: /nonexistent}
workflow:
  - step: start
    tool: {kind: python, code: "result = 1"}
    next:
      arcs: [{step: check}]
  - step: check
    tool:
      kind: python
      args: {marker: "{{ marker }}"}
      code: |
        import os
        if not os.path.exists(marker):
            raise RuntimeError("no marker yet")
        result = "found"
"""


def test_the_projects_own_routes_validate_compile_submit_list_events_resume(server, tmp_path):
    valid = server.post("/api/validate", {"content": b64(HELLO)})
    assert valid.status_code == 200 and valid.json()["steps"] == ["start"]
    compiled = server.post("/api/compile", {"content": b64(HELLO), "workload": {"message": "x"}}).json()
    assert compiled["plan"]["workload"]["message"] == "x" and compiled["steps"][0]["step"] == "start"
    invalid = server.post("/api/validate", {"content": b64(HELLO.replace("kind: python", "kind: nope"))})
    assert invalid.status_code == 400 and invalid.json()["problems"]

    # a playbook body, not registered: it fails until the marker file exists, then resumes
    marker = tmp_path / "marker"
    submitted = server.post("/api/submit", {"content": b64(FLAKY), "workload": {"marker": str(marker)}})
    assert submitted.status_code == 200, submitted.text
    execution_id = submitted.json()["execution_id"]
    failed = server.wait_end(execution_id)
    assert failed["status"] == "failed" and failed["failed_step"] == "check"

    listed = server.get("/api/executions?status=failed&playbook=api_flaky").json()
    assert [e["execution_id"] for e in listed] == [execution_id]
    rows = server.get(f"/api/executions/{execution_id}/events?type=step.completed").json()
    assert [e["step"] for e in rows["events"]] == ["start"]
    first = server.get(f"/api/executions/{execution_id}/events?limit=2").json()
    rest = server.get(f"/api/executions/{execution_id}/events?after={first['next_after']}").json()
    assert len(first["events"]) == 2 and int(rest["events"][0]["id"]) > int(first["next_after"])
    assert server.get("/api/executions/12345/events").status_code == 404

    marker.write_text("here")
    resumed = server.post(f"/api/executions/{execution_id}/resume")
    assert resumed.status_code == 200, resumed.text
    assert resumed.json()["epoch"] == 1
    done = server.wait_end(execution_id)
    assert done["status"] == "completed" and done["results"]["check"] == "found"
    refused = server.post(f"/api/executions/{execution_id}/resume")
    assert refused.status_code == 409  # nothing left to resume: the engine says why


def test_register_list_execute_status_page_and_rerun(server):
    registered = server.register(HELLO)
    assert registered.status_code == 200, registered.text
    assert registered.json()["path"] == "tests/api_hello"
    entries = server.post("/api/catalog/list", {"resource_type": "Playbook"}, auth=False).json()["entries"]
    assert {"path": "tests/api_hello", "name": "api_hello"}.items() <= next(
        e for e in entries if e["path"] == "tests/api_hello"
    ).items()

    # NoETL's client sends --set values flat; a dotted key names a nested value, as with --set
    started = server.post(
        "/api/execute",
        {
            "path": "tests/api_hello",
            "workload": {"message": "from the API", "nested.b": 3},
            "resource_kind": "playbook",
        },
    )
    assert started.status_code == 200, started.text
    execution_id = started.json()["execution_id"]
    status = server.wait_end(execution_id)
    assert status["status"] == "completed" and status["completed"] is True and status["failed"] is False
    assert status["results"]["start"] == {"message": "from the API", "nested": {"a": 1, "b": 3}}
    assert status["completed_steps"] == ["start"] and status["duration_human"]
    assert status["progress"] == {"done": 1, "total": 1}  # the fields of `noetl-celery status --json`

    page = server.get(f"/api/executions/{execution_id}?page=1&page_size=2").json()
    assert page["status"] == "completed" and page["pagination"]["page_size"] == 2
    assert len(page["events"]) == 2 and page["pagination"]["total"] > 2
    assert int(page["events"][0]["id"]) > int(page["events"][1]["id"])  # newest first
    assert page["events"][0]["event_type"] == "execution.completed"
    second = server.get(f"/api/executions/{execution_id}?page=2&page_size=2").json()["events"]
    assert int(second[0]["id"]) < int(page["events"][1]["id"])
    steps = {e["node_name"] for e in server.get(f"/api/executions/{execution_id}?page_size=100").json()["events"]}
    assert "start" in steps

    # rerun: a new execution of the same plan, its workload merged with the one given
    rerun = server.post(f"/api/executions/{execution_id}/rerun", {"workload": {"nested": {"a": 9}}})
    assert rerun.status_code == 200, rerun.text
    new_id = rerun.json()["execution_id"]
    assert new_id != execution_id and rerun.json()["rerun_of"] == execution_id
    assert server.wait_end(new_id)["results"]["start"] == {"message": "from the API", "nested": {"a": 9, "b": 3}}

    # cancelling an execution that ended: 400 with a message, as NoETL answers
    again = server.post(f"/api/executions/{execution_id}/cancel", {"cascade": False})
    assert again.status_code == 400 and "already completed" in again.json()["message"]


JS_CLIENT = """
const [url, id] = process.argv.slice(2);
(async () => {
  for (const path of [`/api/executions/${id}/status`, `/api/executions/${id}`, `/api/executions?limit=5`]) {
    const body = JSON.parse(await (await fetch(url + path)).text());  // JavaScript's own JSON.parse
    const got = path.endsWith("limit=5") ? body.find((e) => e.execution_id === id) : body;
    if (!got || got.execution_id !== id || typeof got.execution_id !== "string") {
      console.log(`${path}: execution_id ${JSON.stringify(got && got.execution_id)}, expected "${id}"`);
      process.exit(1);
    }
    if (path.endsWith("/status") === false && body.events) {
      for (const e of body.events) if (typeof e.id !== "string") { console.log(`event id ${e.id}`); process.exit(1); }
    }
  }
  console.log(`read ${id} intact`);
})();
"""


def test_a_javascript_client_reads_ids_above_2_53_intact(server, tmp_path):
    """Execution ids are 64-bit: as JSON numbers, JavaScript's JSON.parse would round them
    (384866602633132179 -> ...160); every answer sends them as strings."""
    from tests.support.services import ci_mode

    node = shutil.which("node")
    if node is None:
        if ci_mode():
            raise AssertionError("node is missing (.ci/run installs Debian's nodejs)")
        pytest.skip("node is not installed")
    started = server.post("/api/submit", {"content": b64(HELLO)})
    assert started.status_code == 200, started.text
    execution_id = started.json()["execution_id"]
    assert isinstance(execution_id, str) and int(execution_id) > 2**53, execution_id
    server.wait_end(execution_id)
    script = tmp_path / "client.mjs"
    script.write_text(JS_CLIENT)
    done = subprocess.run([node, str(script), server.url, execution_id], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.strip() == f"read {execution_id} intact"
    # and the number form of an id is accepted where an id is asked for
    assert server.get(f"/api/executions?parent={execution_id}").status_code == 200


def test_noetls_gui_routes_as_its_source_calls_them(server):
    """The calls of NoETL's GUI (noetl/gui src/services/api.ts, base URL /api): raw YAML register,
    catalog list and resource, execute by catalog_id, the execution list (an array) and one
    execution with NoETL's pagination, dashboard stats, playbook content, validate, stop."""
    gui_hello = HELLO.replace("api_hello", "gui_hello")
    registered = server.post("/api/catalog/register", {"content": gui_hello, "resource_type": "Playbook"})
    assert registered.status_code == 200, registered.text  # raw YAML, as the GUI sends it
    assert registered.json()["path"] == "tests/gui_hello"
    entries = server.post("/api/catalog/list", {"resource_type": "Playbook"}, auth=False).json()["entries"]
    entry = next(e for e in entries if e["path"] == "tests/gui_hello")
    assert entry["catalog_id"] == "tests/gui_hello" and entry["status"] == "active"
    assert entry["payload"]["metadata"]["name"] == "gui_hello"
    resource = server.post("/api/catalog/resource", {"path": "tests/gui_hello", "version": "latest"}, auth=False)
    assert resource.status_code == 200, resource.text
    assert resource.json()["content"] == gui_hello and resource.json()["payload"]["workload"]["message"] == "hello"
    missing = server.post("/api/catalog/resource", {"path": "tests/nope"}, auth=False)
    assert missing.status_code == 404 and missing.json()["detail"]
    content = server.get("/api/catalog/playbook/content", params={"playbook_id": entry["catalog_id"]})
    assert content.json()["content"] == gui_hello

    started = server.post(
        "/api/execute", {"catalog_id": entry["catalog_id"], "workload": {}, "resource_kind": "playbook"}
    )
    assert started.status_code == 200, started.text
    execution_id = started.json()["execution_id"]
    assert isinstance(execution_id, str)
    server.wait_end(execution_id)
    listed = server.get("/api/executions")
    assert isinstance(listed.json(), list)
    row = next(e for e in listed.json() if e["execution_id"] == execution_id)
    assert row["path"] == "tests/gui_hello" and row["status"] == "completed" and row["progress"] == 100
    assert row["start_time"] and row["duration_human"]
    one = server.get(f"/api/executions/{execution_id}", params={"page": 1, "page_size": 2}).json()
    assert one["pagination"]["total_events"] > 2 and one["pagination"]["has_next"] is True
    assert one["pagination"]["has_prev"] is False and one["pagination"]["total_pages"] >= 2
    typed = server.get(f"/api/executions/{execution_id}", params={"event_type": "step.completed"}).json()
    assert [e["event_type"] for e in typed["events"]] == ["step.completed"]
    since = int(typed["events"][0]["id"])
    later = server.get(f"/api/executions/{execution_id}", params={"since_event_id": since}).json()["events"]
    assert later and all(int(e["id"]) > since for e in later)

    stats = server.get("/api/dashboard/stats").json()
    assert stats["total_playbooks"] >= 1 and stats["total_executions"] >= 1
    assert 0 <= stats["success_rate"] <= 100 and stats["recent_executions"][0]["execution_id"]
    health = server.get("/api/health").json()
    assert health["status"] == "ok" and health["timestamp"] and health["message"]
    valid = server.post("/api/catalog/playbooks/validate", {"content": gui_hello}).json()
    assert valid == {"valid": True, "errors": []}
    invalid = server.post("/api/catalog/playbooks/validate", {"content": gui_hello.replace("python", "nope")}).json()
    assert invalid["valid"] is False and invalid["errors"]
    assert server.get("/api/credentials").json()["items"] == []
    stopped = server.post(f"/api/executions/{execution_id}/stop")
    assert stopped.status_code == 400 and "already completed" in stopped.json()["detail"]


def test_executions_filtered_by_time_status_playbook_parent_with_cursor_paging(server):
    ids = []
    for _ in range(3):
        started = server.post("/api/submit", {"content": b64(HELLO.replace("api_hello", "api_paged"))})
        ids.append(started.json()["execution_id"])
    for execution_id in ids:
        server.wait_end(execution_id)
    first = server.get("/api/executions", params={"playbook": "api_paged", "limit": 2})
    assert [e["execution_id"] for e in first.json()] == ids[::-1][:2]  # newest first
    cursor = first.headers["X-Next-Cursor"]
    assert 'rel="next"' in first.headers["Link"] and f"cursor={cursor}" in first.headers["Link"]
    second = server.get("/api/executions", params={"playbook": "api_paged", "limit": 2, "cursor": cursor})
    assert [e["execution_id"] for e in second.json()] == [ids[0]] and "X-Next-Cursor" not in second.headers
    follow = requests.get(server.url + first.headers["Link"].split(">")[0].lstrip("<"), timeout=30)
    assert follow.json() == second.json()
    starts = [e["start_time"] for e in first.json()]
    window = server.get(
        "/api/executions", params={"playbook": "api_paged", "since": starts[1], "until": starts[0]}
    ).json()
    assert [e["execution_id"] for e in window] == [ids[1]]  # since <= start < until
    future = server.get("/api/executions", params={"since": "2999-01-01T00:00:00Z"}).json()
    assert future == []
    assert server.get("/api/executions", params={"status": "completed", "playbook": "api_paged"}).json()
    assert server.get("/api/executions", params={"status": "failed", "playbook": "api_paged"}).json() == []
    assert server.get("/api/executions", params={"parent": ids[0]}).json() == []
    for name, value in (("since", "yesterday"), ("parent", "x1"), ("cursor", "-3")):
        bad = server.get("/api/executions", params={name: value})
        assert bad.status_code == 400 and bad.json()["field"] == name, bad.text


def raw_exchange(server: Server, head: str, body: bytes = b"") -> tuple[int, dict[str, str], bytes]:
    """Send a request's head (and `body`) over a socket; the answer's status, headers and body,
    read as soon as the server sends them."""
    import socket

    with socket.create_connection(("127.0.0.1", server.port), timeout=30) as sock:
        sock.sendall(head.encode() + body)
        data = b""
        while b"\r\n\r\n" not in data:
            chunk = sock.recv(65536)
            assert chunk, data
            data += chunk
        head_bytes, _, rest = data.partition(b"\r\n\r\n")
        lines = head_bytes.decode().split("\r\n")
        headers = {k.lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:])}
        while len(rest) < int(headers.get("content-length", 0)):
            rest += sock.recv(65536)
        return int(lines[0].split()[1]), headers, rest


def test_the_token_and_the_size_are_checked_before_the_body_is_read(server):
    big = 60_000_000  # a 60 MB body announced, never sent: the answer comes before it
    head = (
        f"POST /api/catalog/register HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {big}\r\n"
    )
    status, headers, body = raw_exchange(server, head + "\r\n")
    assert status == 401 and headers["www-authenticate"].startswith("Bearer"), body
    assert "Bearer" in json.loads(body)["detail"]
    status, _, body = raw_exchange(server, head + f"Authorization: Bearer {TOKEN}\r\n\r\n")
    assert status == 413 and json.loads(body)["field"] == "body", body
    assert "NOETL_API_MAX_BODY_BYTES" in json.loads(body)["detail"]
    # a chunked body (no Content-Length) is cut at the limit
    chunk = b"x" * 1_000_000
    chunked = b"".join(b"%x\r\n%s\r\n" % (len(chunk), chunk) for _ in range(9)) + b"0\r\n\r\n"
    status, _, body = raw_exchange(
        server,
        f"POST /api/submit HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\nAuthorization: Bearer {TOKEN}\r\n\r\n",
        chunked,
    )
    assert status == 413, body


def test_every_error_is_json_with_allow_on_405(server):
    for path in (
        "/api/nope",
        "/api/executions/abc",
        "/nope/at/all",
        f"/api/executions/{2**64}",
        f"/executions/{2**64}",
    ):
        answer = server.get(path)
        assert answer.status_code == 404, (path, answer.text[:200])
        if path.startswith("/api/") or path.startswith("/nope"):
            assert answer.headers["Content-Type"].startswith("application/json"), path
            assert answer.json()["detail"], path
    for method, path, allow in (
        ("GET", "/api/execute", "POST"),
        ("DELETE", "/api/executions", "GET"),
        ("PUT", "/api/schedules", "GET, POST"),
        ("POST", "/api/executions/1/status", "GET"),
    ):
        answer = requests.request(method, server.url + path, headers=AUTH, timeout=30)
        assert answer.status_code == 405, (method, path, answer.text)
        assert answer.headers["Allow"] == allow, (method, path)
        assert answer.json()["detail"].startswith(f"{method} is not allowed"), answer.text
    weird = requests.request("PROPFIND", server.url + "/api/executions", timeout=30)
    assert weird.status_code == 405 and weird.headers["Allow"] == "GET" and weird.json()["detail"]


CHATTY = """apiVersion: noetl.io/v10
kind: Playbook
metadata: {name: api_chatty}
workflow:
  - step: start
    tool: {kind: python, code: "result = 1"}
    next:
      arcs: [{step: talk}]
  - step: talk
    tool:
      kind: python
      code: |
        import logging, sys
        print("to stdout")
        print("to stderr", file=sys.stderr)
        logging.getLogger("chatty").warning("a logging line")
        raise RuntimeError("talked enough")
"""


def test_an_attempts_log_route_gives_what_it_wrote(server):
    started = server.post("/api/submit", {"content": b64(CHATTY)})
    execution_id = started.json()["execution_id"]
    assert server.wait_end(execution_id)["status"] == "failed"
    attempts = server.get(f"/api/executions/{execution_id}/attempts").json()["attempts"]
    assert [a["step"] for a in attempts] == ["start", "talk"] and [a["n"] for a in attempts] == [1, 2]
    assert attempts[1]["status"] == "failed" and attempts[1]["has_output"] is True
    log = server.get(f"/api/executions/{execution_id}/attempts/2/log").json()
    assert log["stdout"] == "to stdout\n" and log["stderr"] == "to stderr\n", log
    assert any("a logging line" in str(line) for line in log["log"]), log["log"]
    assert "talked enough" in log["error"]["message"] and log["retry"] == 1 and log["step"] == "talk"
    quiet = server.get(f"/api/executions/{execution_id}/attempts/1/log").json()
    assert quiet["stdout"] == "" and quiet["log"] == [] and quiet["step"] == "start"
    for path in (
        f"/api/executions/{execution_id}/attempts/3/log",
        f"/api/executions/{execution_id}/attempts/0/log",
        "/api/executions/12345/attempts/1/log",
        "/api/executions/12345/attempts",
    ):
        missing = server.get(path)
        assert missing.status_code == 404 and missing.json()["detail"], path


def test_unknown_execution_and_catalog_path_get_404(server):
    assert server.get("/api/executions/12345/status").status_code == 404
    assert server.get("/api/executions/12345").status_code == 404
    assert server.post("/api/executions/12345/cancel", {}).status_code == 404
    assert server.post("/api/executions/12345/rerun", {}).status_code == 404
    missing = server.post("/api/execute", {"path": "no/such/playbook"})
    assert missing.status_code == 404 and missing.json()["field"] == "path"
    # a path is looked up in the catalog only, never as a file of the server's machine
    local = server.post("/api/execute", {"path": str(REPO_ROOT / "noetl_celery/examples/hello_world.yaml")})
    assert local.status_code == 404


def test_an_invalid_playbook_is_refused_with_its_problems(server):
    no_path = HELLO.replace(", path: tests/api_hello", "")
    answer = server.register(no_path)
    assert answer.status_code == 400
    assert any("metadata.path" in p for p in answer.json()["problems"])


def test_cancel_a_running_loop_and_cleanup(server):
    assert server.register(SLOW_LOOP).status_code == 200
    first = server.post("/api/execute", {"path": "tests/api_slow_loop"}).json()["execution_id"]
    server.wait_started(first, "work")
    cancelled = server.post(f"/api/executions/{first}/cancel", {"cascade": True, "reason": "enough"})
    assert cancelled.status_code == 200, cancelled.text
    assert cancelled.json()["cancelled_executions"] == [str(first)]
    status = server.wait_end(first)
    assert status["status"] == "cancelled" and status["error"]["message"] == "enough"

    second = server.post("/api/execute", {"path": "tests/api_slow_loop"}).json()["execution_id"]
    dry = server.post("/api/executions/cleanup", {"older_than_minutes": 0, "dry_run": True}).json()
    assert second in dry["execution_ids"] and dry["dry_run"] is True
    assert server.get(f"/api/executions/{second}/status").json()["status"] == "running"
    assert first not in dry["execution_ids"]  # ended already
    done = server.post("/api/executions/cleanup", {"older_than_minutes": 0}).json()
    assert second in done["execution_ids"] and done["cancelled_count"] >= 1
    assert server.wait_end(second)["status"] == "cancelled"


def test_credentials_are_not_registered_here(server):
    for answer in (
        server.post("/api/credentials", {"name": "pg", "type": "postgres", "data": {"password": "x"}}),
        server.post("/api/catalog/register", {"content": b64("{}"), "resource_type": "Credential"}),
        server.get("/api/credentials/pg"),
    ):
        assert answer.status_code == 501, answer.text
        assert "NOETL_AUTH_" in answer.json()["detail"]


def test_secrets_are_masked_in_answers(server):
    assert server.register(HELLO).status_code == 200
    secret = "s3cr3t-api-token-value"
    started = server.post("/api/execute", {"path": "tests/api_hello", "workload": {"message": secret}})
    assert secret not in started.text
    execution_id = started.json()["execution_id"]
    server.wait_end(execution_id)
    for path in (f"/api/executions/{execution_id}/status", f"/api/executions/{execution_id}?page_size=100"):
        answer = server.get(path)
        assert answer.status_code == 200 and secret not in answer.text and "***" in answer.text


def test_writes_are_refused_without_a_configured_token_and_dashboard_runs_nothing(tmp_path):
    """`dashboard` (the alias without the embedded worker) and no NOETL_DASHBOARD_TOKEN: reads
    answer, every write is refused (403), and an execute with the token would find no worker."""
    dashboard = Server(tmp_path / "home", tmp_path / "dashboard.log", command="dashboard", token=None)
    try:
        assert dashboard.get("/health").json()["runs_executions"] is False
        answer = dashboard.post("/api/execute", {"path": "tests/api_hello"})
        assert answer.status_code == 403 and "NOETL_DASHBOARD_TOKEN" in answer.json()["detail"]
        assert dashboard.get("/").status_code == 200  # the dashboard's pages are served too
    finally:
        dashboard.stop()
    guarded = Server(tmp_path / "home", tmp_path / "guarded.log", command="dashboard")
    try:
        assert guarded.register(HELLO).status_code == 200
        answer = guarded.post("/api/execute", {"path": "tests/api_hello"})
        assert answer.status_code == 503 and "noetl-celery server" in answer.json()["detail"]
    finally:
        guarded.stop()


# --- NoETL's own client --------------------------------------------------------------------


@pytest.fixture(scope="session")
def noetl_client() -> Path:
    """NoETL's `noetl` command from PyPI, in a venv made once per machine, client version and
    Python: the processes of a session (pytest-xdist) and later sessions share it. A lock file
    serialises the first install; a marker written after it says the venv is complete."""
    home = (
        Path(tempfile.gettempdir())
        / f"noetl-celery-tests-{NOETL_CLIENT.replace('==', '-')}-py{sys.version_info[0]}{sys.version_info[1]}"
    )
    venv, installed = home / "venv", home / "installed"
    home.mkdir(exist_ok=True)
    with open(home / "lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        if installed.exists():
            return venv / "bin" / "noetl"
        shutil.rmtree(venv, ignore_errors=True)  # an install cut short
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
        pip = subprocess.run(
            [str(venv / "bin" / "pip"), "install", "-q", "--disable-pip-version-check", NOETL_CLIENT],
            capture_output=True,
            text=True,
            timeout=300,
        )
        if pip.returncode != 0:
            shutil.rmtree(venv, ignore_errors=True)
            pytest.fail(f"cannot install {NOETL_CLIENT}: {pip.stderr[-2000:]}")
        installed.write_text(NOETL_CLIENT)
    return venv / "bin" / "noetl"


def noetl(client: Path, server: Server, *args: str, cwd: Path, token: str | None = TOKEN):
    env = {k: v for k, v in os.environ.items() if not k.startswith("NOETL_")}
    env["HOME"] = str(cwd)  # the client's own config file goes there, not to the user's home
    if token:
        env["NOETL_SESSION_TOKEN"] = token  # the client sends it as Authorization: Bearer
    return subprocess.run(
        [str(client), "--server-url", server.url, *args], capture_output=True, text=True, timeout=60, cwd=cwd, env=env
    )


def test_noetls_own_client_drives_the_server(noetl_client, server, tmp_path):
    """On the embedded default: the server's own embedded worker runs what the client starts."""
    drive_with_noetl_client(noetl_client, server, tmp_path)


@pytest.mark.services
def test_noetls_own_client_drives_the_server_on_redis_and_postgresql_with_two_workers(
    noetl_client, tmp_path, redis_url, postgres_url, worker_factory
):
    """With a broker the server runs nothing itself: two real `celery worker` processes run the
    executions NoETL's client starts, and the client's cancel stops a loop running on them."""
    from noetl_celery.store.db import migrate, transaction

    migrate(postgres_url)
    env = {"NOETL_BROKER_URL": redis_url, "NOETL_DATABASE_URL": postgres_url}
    workers = [worker_factory(env=env, concurrency=2) for _ in range(2)]
    server = Server(tmp_path / "home", tmp_path / "server.log", settings=env)
    try:
        listening = server.log_path.read_text()
        assert "server on http://" in listening and "embedded" not in listening, listening
        ids = drive_with_noetl_client(noetl_client, server, tmp_path)
    finally:
        server.stop()
    with transaction(postgres_url) as conn:
        ran_on = {
            row[0]
            for row in conn.execute(
                text(
                    "SELECT DISTINCT worker FROM noetl_event WHERE execution_id IN :ids AND worker IS NOT NULL"
                ).bindparams(bindparam("ids", expanding=True)),
                {"ids": ids},
            )
        }
    assert ran_on and ran_on <= {w.node for w in workers}, ran_on


def drive_with_noetl_client(noetl_client: Path, server: Server, tmp_path: Path) -> list[int]:
    """NoETL's client: register, catalog list, run --set, status to the end, cancel of a running
    loop; returns the two execution ids."""
    (tmp_path / "hello.yaml").write_text(HELLO.replace("api_hello", "client_hello"))
    (tmp_path / "slow.yaml").write_text(SLOW_LOOP.replace("api_slow_loop", "client_slow_loop"))

    refused = noetl(noetl_client, server, "register", "playbook", "-f", "hello.yaml", cwd=tmp_path, token=None)
    assert refused.returncode == 1 and "401" in refused.stderr

    for file in ("hello.yaml", "slow.yaml"):
        registered = noetl(noetl_client, server, "register", "playbook", "-f", file, cwd=tmp_path)
        assert registered.returncode == 0, registered.stderr
        assert "registered successfully" in registered.stdout

    listed = noetl(noetl_client, server, "catalog", "list", "Playbook", "--json", cwd=tmp_path)
    assert listed.returncode == 0, listed.stderr
    paths = [e["path"] for e in json.loads(listed.stdout)["entries"]]
    assert {"tests/client_hello", "tests/client_slow_loop"} <= set(paths)

    ran = noetl(
        noetl_client,
        server,
        *("run", "tests/client_hello", "-r", "distributed", "--set", "message=from NoETL", "--set", "nested.b=5"),
        "--json",
        cwd=tmp_path,
    )
    assert ran.returncode == 0, ran.stderr
    execution_id = json.loads(ran.stdout)["execution_id"]

    deadline = time.monotonic() + END_TIMEOUT
    while True:
        polled = noetl(noetl_client, server, "status", str(execution_id), "--json", cwd=tmp_path)
        assert polled.returncode == 0, polled.stderr
        status = json.loads(polled.stdout)
        if status["status"] != "running" or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert status["status"] == "completed" and status["completed"] is True
    assert status["results"]["start"] == {"message": "from NoETL", "nested": {"a": 1, "b": 5}}
    summary = noetl(noetl_client, server, "status", str(execution_id), cwd=tmp_path)
    assert "COMPLETED" in summary.stdout and "- start" in summary.stdout

    slow = noetl(noetl_client, server, "run", "tests/client_slow_loop", "-r", "distributed", "--json", cwd=tmp_path)
    slow_id = json.loads(slow.stdout)["execution_id"]
    server.wait_started(slow_id, "work")
    cancelled = noetl(noetl_client, server, "cancel", str(slow_id), "--reason", "from NoETL", cwd=tmp_path)
    assert cancelled.returncode == 0, cancelled.stderr
    assert "CANCELLED" in cancelled.stdout and "Cancelled: 1 execution(s)" in cancelled.stdout
    final = server.wait_end(slow_id)
    assert final["status"] == "cancelled" and final["error"]["message"] == "from NoETL"
    return [execution_id, slow_id]
