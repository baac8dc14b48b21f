"""The REST routes that take a playbook or a workload answer 400 with the reason for any body
(issue 39): deeply nested JSON, a workload nested past NOETL_MAX_INPUT_DEPTH, a playbook with a
NUL character or nested 700 levels, a list where a name belongs. A real server over loopback."""

from __future__ import annotations

from pathlib import Path

import pytest
import requests

from tests.test_server import AUTH, Server, b64

SEEDS = Path(__file__).parent / "fuzz_seeds"
ROUTES = ("/api/validate", "/api/compile", "/api/submit")


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = tmp_path_factory.mktemp("hostile")
    running = Server(root / "home", root / "server.log")
    yield running
    assert running.stop() == 0, running.log_path.read_text()[-3000:]


@pytest.mark.parametrize("route", [*ROUTES, "/api/execute", "/api/catalog/register"])
@pytest.mark.parametrize("seed", ["json_body_nested_5000.json", "json_workload_nested_300.json"])
def test_a_deeply_nested_json_body_is_400_naming_its_line(server, route, seed) -> None:
    answer = requests.post(server.url + route, data=(SEEDS / seed).read_bytes(), headers=AUTH, timeout=30)
    assert answer.status_code == 400, answer.text
    error = answer.json()
    assert error["field"] == "body" and "NOETL_MAX_INPUT_DEPTH" in error["detail"], error
    assert error["detail"].startswith("body: line 1: nested"), error


@pytest.mark.parametrize("route", ROUTES)
@pytest.mark.parametrize("seed", sorted(path.name for path in SEEDS.glob("*.yaml")))
def test_a_hostile_playbook_is_400_with_file_line_and_message(server, route, seed) -> None:
    content = (SEEDS / seed).read_bytes().decode("utf-8")
    answer = server.post(route, {"content": b64(content)})
    assert answer.status_code == 400, answer.text
    problems = answer.json()["problems"]
    assert problems and all(problem.startswith("content:") for problem in problems), problems
    assert problems[0].split(":")[1].isdigit(), problems


def test_a_workload_within_the_body_limit_but_deep_after_dotted_keys_is_400(server) -> None:
    deep: object = 1
    for _ in range(95):
        deep = {"k": deep}
    workload = {".".join(["a"] * 10): deep}  # 95 levels, 10 more once the dotted key is nested
    hello = (Path(__file__).resolve().parents[1] / "playbooks" / "hello_world.yaml").read_text()
    answer = server.post("/api/validate", {"content": b64(hello), "workload": workload})
    assert answer.status_code == 400, answer.text
    assert "NOETL_MAX_INPUT_DEPTH" in " ".join(answer.json()["problems"]), answer.json()
