"""Rerun and launch through `noetl-celery server` (its embedded worker runs what it starts): the
REST API's rerun with from_step and latest, and a real browser (headless Chromium) rerunning a
failed step with a fixed version of the playbook and launching a playbook from its form."""

from __future__ import annotations

import base64
import shutil
import time
from pathlib import Path

import pytest
import requests

from tests.support import browser
from tests.support.services import ci_mode
from tests.test_rerun import V1_TOTAL, V2_TOTAL, ledger
from tests.test_server import TOKEN, Server

BASIC = {"Authorization": "Basic " + base64.b64encode(f"ops:{TOKEN}".encode()).decode()}
PAGE_TIMEOUT = 30  # seconds for a page to show what is awaited


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = tmp_path_factory.mktemp("rerun-server")
    s = Server(root / "home", root / "server.log")
    s.root = root
    yield s
    assert s.stop() == 0, s.log_path.read_text()[-3000:]


def failed_ledger(server: Server, path: str) -> tuple[int, Path]:
    """An execution of version 1 of the ledger (registered at `path`) that failed at `total`;
    the file its steps write their names to."""
    trail = server.root / f"{path.replace('/', '_')}.trail"
    assert server.register(ledger(V1_TOTAL, path)).status_code == 200
    started = server.post("/api/execute", {"path": path, "workload": {"trail": str(trail)}})
    assert started.status_code == 200, started.text
    status = server.wait_end(started.json()["execution_id"])
    assert status["status"] == "failed" and status["failed_step"] == "total", status
    assert trail.read_text().split() == ["start", "fetch", "total"]
    return int(status["execution_id"]), trail


def events_of(server: Server, execution_id: int) -> list[dict]:
    return server.get(f"/api/executions/{execution_id}/events?limit=1000").json()["events"]


def test_the_api_reruns_from_a_failed_step_with_the_latest_version(server):
    old, trail = failed_ledger(server, "tests/api_rerun")
    assert server.register(ledger(V2_TOTAL, "tests/api_rerun")).status_code == 200
    url = f"/api/executions/{old}/rerun"

    # writes need the token; a bad body names its field; a step that cannot be rerun from is refused
    assert server.post(url, {"from_step": "total"}, auth=False).status_code == 401
    for body, field in (({"from_step": 5}, "from_step"), ({"latest": "yes"}, "latest"), ({"workload": 1}, "workload")):
        refused = server.post(url, body)
        assert refused.status_code == 400 and refused.json()["field"] == field, refused.text
    for step, message in (("nope", "has no step 'nope'"), ("report", "never started")):
        refused = server.post(url, {"from_step": step})
        assert refused.status_code == 400 and message in refused.json()["detail"], refused.text
        assert refused.json()["field"] == "from_step"
    assert server.post("/api/executions/4242/rerun", {"from_step": "total"}).status_code == 404

    trail.write_text("")
    made = server.post(url, {"from_step": "total", "latest": True, "workload": {"bonus": 3}})
    assert made.status_code == 200, made.text
    assert made.json() | {"execution_id": 0} == {
        "execution_id": 0,
        "rerun_of": str(old),  # ids are strings in every answer
        "from_step": "total",
        "latest": True,
        "status": "running",
    }
    new_id = made.json()["execution_id"]
    status = server.wait_end(new_id)
    assert status["status"] == "completed" and status["rerun_of"] == str(old) and status["from_step"] == "total"
    assert status["results"]["total"] == {"sum": 28}
    assert trail.read_text().split() == ["total", "report"]  # start and fetch did not run again
    events = events_of(server, new_id)
    assert {e["step"] for e in events if e["event_type"].startswith("action.")} == {"total", "report"}
    assert [e["step"] for e in events if (e["meta"] or {}).get("seeded_from") == old] == ["start", "fetch"]
    page = server.get(f"/api/executions/{new_id}").json()
    assert page["rerun"]["rerun_of"] == str(old) and page["rerun"]["plan"] == "catalog"
    assert page["steps"]["fetch"]["state"] == "completed" and page["steps"]["fetch"]["runs"] == 0

    # the whole playbook again, with the old parameters (trail) and one changed
    trail.write_text("")
    whole = server.post(url, {"workload": {"bonus": 10}, "latest": True, "resource_kind": "playbook"})
    assert whole.status_code == 200, whole.text
    status = server.wait_end(whole.json()["execution_id"])
    assert status["status"] == "completed" and status["from_step"] is None
    assert status["results"]["total"] == {"sum": 35}
    assert trail.read_text().split() == ["start", "fetch", "total", "report"]


def test_the_openapi_document_describes_rerun(server):
    from openapi_spec_validator import validate

    document = server.get("/api/openapi.json").json()
    validate(document)
    rerun = document["paths"]["/api/executions/{execution_id}/rerun"]["post"]
    ref = rerun["requestBody"]["content"]["application/json"]["schema"]["$ref"]
    body = document["components"]["schemas"][ref.rsplit("/", 1)[1]]["properties"]
    assert {"workload", "resource_kind", "from_step", "latest"} <= set(body)
    assert rerun["security"] == [{"bearer": []}]


def chrome(tmp_path):
    try:
        driver = browser.chrome(str(tmp_path / "profile"))
    except browser.BrowserUnavailable as exc:
        (pytest.fail if ci_mode() else pytest.skip)(str(exc))
    driver.execute_cdp_cmd("Network.enable", {})
    driver.execute_cdp_cmd("Network.setExtraHTTPHeaders", {"headers": BASIC})  # as a browser that cached them
    return driver


def wait_for(driver, text: str) -> str:
    deadline = time.monotonic() + PAGE_TIMEOUT
    while time.monotonic() < deadline:
        html = driver.page_source
        if text in html:
            return html
        time.sleep(0.2)
    raise AssertionError(f"{text!r} not in the page: {driver.page_source[:3000]}")


def new_execution_id(driver, server: Server, old: int | None = None) -> int:
    """The id of the execution page the browser was sent to."""
    deadline = time.monotonic() + PAGE_TIMEOUT
    while time.monotonic() < deadline:
        current = driver.current_url.removeprefix(f"{server.url}/executions/")
        if current.isdigit() and int(current) != old:
            return int(current)
        time.sleep(0.1)
    raise AssertionError(f"not on a new execution's page: {driver.current_url}")


def keep_screenshots(tmp_path: Path, *names: str) -> None:
    browser.ARTIFACTS.mkdir(exist_ok=True)
    for name in names:
        if (tmp_path / name).exists():
            shutil.copy(tmp_path / name, browser.ARTIFACTS / f"dashboard-{name}")


def test_a_browser_reruns_the_failed_step_with_the_fixed_version(server, tmp_path):
    """The failed step runs again with the fixed version, the steps before it are not re-run,
    and the execution completes."""
    from selenium.webdriver.common.by import By

    old, trail = failed_ledger(server, "tests/browser_rerun")
    assert server.register(ledger(V2_TOTAL, "tests/browser_rerun")).status_code == 200
    trail.write_text("")
    driver = chrome(tmp_path)
    try:
        driver.get(f"{server.url}/executions/{old}")
        driver.save_screenshot(str(tmp_path / "rerun-form.png"))
        buttons = driver.find_elements(By.CSS_SELECTOR, "#rerun button.rerun-from")
        assert [b.get_attribute("data-step") for b in buttons] == ["total"]
        driver.find_element(By.ID, "rerun-latest").click()
        driver.find_element(By.ID, "rerun-set").send_keys("bonus=4")
        buttons[0].click()
        new_id = new_execution_id(driver, server, old)
        html = wait_for(driver, 'data-status="completed"')
        assert f'made by a rerun of <a href="/executions/{old}">{old}</a>' in html
        assert "from step <code>total</code> (kept: fetch, start)" in html
        driver.save_screenshot(str(tmp_path / "rerun.png"))
    finally:
        driver.quit()
        keep_screenshots(tmp_path, "rerun-form.png", "rerun.png")
    status = server.wait_end(new_id)
    assert status["status"] == "completed" and status["rerun_of"] == str(old) and status["from_step"] == "total"
    assert status["results"]["total"] == {"sum": 29}  # the fixed version's code, with bonus=4
    assert status["results"]["start"] == {"base": 10} and status["results"]["fetch"] == {"value": 20}
    assert trail.read_text().split() == ["total", "report"]
    events = events_of(server, new_id)
    attempts = [(e["step"], e["attempt"]) for e in events if e["event_type"] in ("action.completed", "action.failed")]
    assert attempts == [("total", 1), ("report", 1)]
    assert not [e for e in events if e["event_type"] == "step.started" and e["step"] in ("start", "fetch")]
    assert server.get(f"/api/executions/{old}/status").json()["status"] == "failed"  # left as it was


def test_a_browser_launches_a_playbook_from_its_form(server, tmp_path):
    from selenium.webdriver.common.by import By

    trail = server.root / "launch.trail"
    assert server.register(ledger(V2_TOTAL, "tests/browser_launch")).status_code == 200
    driver = chrome(tmp_path)
    try:
        driver.get(f"{server.url}/playbooks")
        driver.find_element(By.LINK_TEXT, "tests/browser_launch").click()
        wait_for(driver, 'id="launch-fields"')
        fields = {f.get_attribute("data-key"): f for f in driver.find_elements(By.CSS_SELECTOR, "#launch-fields input")}
        assert {k: f.get_attribute("value") for k, f in fields.items()} == {
            "trail": "/dev/null",
            "base": "10",
            "bonus": "1",
        }
        fields["trail"].clear()
        fields["trail"].send_keys(str(trail))
        fields["base"].clear()
        fields["base"].send_keys("7")
        driver.save_screenshot(str(tmp_path / "launch-form.png"))
        driver.find_element(By.ID, "launch-button").click()
        new_id = new_execution_id(driver, server)
        wait_for(driver, 'data-status="completed"')
    finally:
        driver.quit()
        keep_screenshots(tmp_path, "launch-form.png")
    status = server.wait_end(new_id)
    assert status["status"] == "completed", status
    assert status["results"]["start"] == {"base": 7}  # a number, as the default was
    assert status["results"]["total"] == {"sum": 7 * 2 + 5 + 1}
    assert trail.read_text().split() == ["start", "fetch", "total", "report"]
    page = server.get(f"/api/executions/{new_id}").json()
    assert page["workload"] == {"trail": str(trail), "base": 7, "bonus": 1}


def test_the_launch_and_rerun_forms_need_the_token_and_the_pages_origin(server):
    """As a script without credentials, or with them but without the page's XSRF token: refused."""
    old, _ = failed_ledger(server, "tests/forms_guarded")

    def count() -> int:
        return len(server.get("/api/executions?playbook=rerun_ledger&limit=1000").json())

    before = count()
    for path in (f"/executions/{old}/rerun", "/playbooks/tests/forms_guarded"):
        anonymous = requests.post(server.url + path, data={"from_step": "total"}, timeout=10)
        assert anonymous.status_code in (401, 403), anonymous.text
        forged = requests.post(server.url + path, data={"from_step": "total"}, headers=BASIC, timeout=10)
        assert forged.status_code == 403 and "XSRF" in forged.reason, forged.reason
    assert count() == before  # nothing was started
