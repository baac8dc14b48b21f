"""The mcp tool against a real MCP server (the SDK's MCPServer, tests/support/mcp_server.py):
over streamable HTTP (a server the test starts on a loopback port) and over stdio (a server the
tool starts for the call and stops after it). On the harness, embedded and on real workers."""

from __future__ import annotations

import json
import subprocess
import sys
import time
import uuid
from pathlib import Path

import psutil
import pytest

from noetl_celery.tools.base import ToolCall, run_tool
from tests.e2e.conftest import API_TOKEN
from tests.support.services import _tcp_answers, free_port, stop_process

REPO = Path(__file__).resolve().parents[2]
PLAYBOOK = REPO / "tests" / "playbooks" / "mcp_tools.yaml"


@pytest.fixture(scope="module")
def mcp_endpoint():
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "tests.support.mcp_server", "http", str(port)],
        cwd=REPO,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 30
    while not _tcp_answers("127.0.0.1", port, 0.5):
        assert proc.poll() is None and time.monotonic() < deadline, "the MCP server did not start"
        time.sleep(0.1)
    yield f"http://127.0.0.1:{port}/mcp"
    stop_process(proc)


def _call(**config) -> dict:
    outcome = run_tool(ToolCall(kind="mcp", config=config, context={}))
    return outcome.to_dict()


@pytest.mark.smoke
def test_tools_over_http_and_stdio(engine, mcp_endpoint):
    sets = {"endpoint": mcp_endpoint, "python": sys.executable, "repo": str(REPO)}
    run = engine.run(PLAYBOOK, sets)
    assert run.returncode == 0, (run.status.get("error"), run.stderr)
    assert run.results["end"] == {
        "names": ["add", "echo_env", "fail", "sleep"],
        "sum": "42",
        "structured": 42,
        "echoed": "hello from the step",
    }
    added = run.results["added"]
    assert added["status"] == "ok" and added["method"] == "tools/call" and added["tool"] == "add"
    assert added["arguments"] == {"a": 2, "b": 40} and added["endpoint"] == mcp_endpoint
    assert added["initialize"]["serverInfo"]["name"] == "noetl-test-tools"


def test_a_tool_error_fails_the_attempt_with_the_result(mcp_endpoint):
    outcome = _call(endpoint=mcp_endpoint, tool="fail", arguments={"reason": "nope"})
    assert outcome["status"] == "error"
    assert outcome["error"]["kind"] == "mcp" and not outcome["error"]["retryable"]
    assert outcome["data"]["result"]["isError"] is True and outcome["data"]["tool"] == "fail"


def test_an_unreachable_server_is_a_retryable_connection_error():
    outcome = _call(endpoint=f"http://127.0.0.1:{free_port()}/mcp", tool="add", arguments={"a": 1, "b": 1})
    assert outcome["error"]["kind"] == "connection" and outcome["error"]["retryable"]


def test_a_request_past_its_timeout_fails_and_the_stdio_server_is_stopped():
    marker = f"mcp-marker-{uuid.uuid4().hex}"
    started = time.monotonic()
    outcome = _call(
        command=[sys.executable, "-m", "tests.support.mcp_server", "stdio", marker],
        cwd=str(REPO),
        tool="sleep",
        arguments={"seconds": 60},
        timeout_seconds=2,
    )
    assert outcome["error"]["kind"] == "timeout" and outcome["error"]["retryable"]
    assert time.monotonic() - started < 30
    deadline = time.monotonic() + 10
    while any(marker in " ".join(p.info["cmdline"] or ()) for p in psutil.process_iter(["cmdline"])):
        assert time.monotonic() < deadline, "the stdio MCP server outlived the call"
        time.sleep(0.2)


def test_health_and_unknown_method(mcp_endpoint):
    unknown = _call(endpoint=mcp_endpoint, method="sampling/createMessage")
    assert unknown["error"]["kind"] == "invalid_args" and "tools/list" in unknown["error"]["message"]
    health = _call(endpoint=mcp_endpoint, method="health")  # the test server has no /healthz
    assert health["error"]["kind"] == "mcp" and "HTTP 404" in health["error"]["message"]


def test_the_endpoint_comes_from_the_environment_by_server_name(mcp_endpoint, monkeypatch):
    monkeypatch.setenv("NOETL_MCP_TOOLS_BOX_URL", mcp_endpoint)
    outcome = _call(server="tools-box", method="tools/list")
    assert outcome["status"] == "ok" and outcome["data"]["endpoint"] == mcp_endpoint


def test_a_credential_goes_as_a_header_and_never_into_the_result(mcp_endpoint):
    outcome = run_tool(
        ToolCall(kind="mcp", config={"endpoint": mcp_endpoint, "method": "tools/list"}, credential=API_TOKEN)
    )
    assert outcome.status == "ok"
    assert API_TOKEN not in json.dumps(outcome.to_dict(), default=str)
