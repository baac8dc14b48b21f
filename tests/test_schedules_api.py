"""The schedules' routes of `noetl-celery server` over real HTTP on loopback: writes need the
token, bad bodies get 400 naming the field, and add/list/show/pause/resume/remove round-trip."""

from __future__ import annotations

import pytest
import requests

from tests.test_server import AUTH, HELLO, Server


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = tmp_path_factory.mktemp("schedules-server")
    s = Server(root / "home", root / "server.log")
    assert s.register(HELLO).status_code == 200
    yield s
    assert s.stop() == 0, s.log_path.read_text()[-3000:]


def delete(server: Server, path: str, auth: bool = True) -> requests.Response:
    return requests.delete(server.url + path, headers=AUTH if auth else {}, timeout=30)


@pytest.mark.parametrize(
    ("method", "path"),
    [
        ("post", "/api/schedules"),
        ("post", "/api/schedules/nightly/pause"),
        ("post", "/api/schedules/nightly/resume"),
        ("delete", "/api/schedules/nightly"),
    ],
)
def test_every_schedule_write_needs_the_bearer_token(server, method, path):
    body = {"name": "nightly", "playbook": "tests/api_hello", "cron": "0 3 * * *"}
    for headers in ({}, {"Authorization": "Bearer wrong"}):
        answer = requests.request(method, server.url + path, json=body, headers=headers, timeout=30)
        assert answer.status_code == 401, answer.text
    assert server.get("/api/schedules").json() == {"schedules": []}  # nothing was added


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"playbook": "tests/api_hello", "every": 5}, "name"),
        ({"name": "a b", "playbook": "tests/api_hello", "every": 5}, "name"),
        ({"name": "x", "every": 5}, "playbook"),
        ({"name": "x", "playbook": "tests/nowhere", "every": 5}, "playbook"),
        ({"name": "x", "playbook": "tests/api_hello"}, "cron"),
        ({"name": "x", "playbook": "tests/api_hello", "cron": "every day"}, "cron"),
        ({"name": "x", "playbook": "tests/api_hello", "every": "5"}, "every"),
        ({"name": "x", "playbook": "tests/api_hello", "every": 0}, "every"),
        ({"name": "x", "playbook": "tests/api_hello", "every": 5, "timezone": "Nowhere/City"}, "timezone"),
        ({"name": "x", "playbook": "tests/api_hello", "every": 5, "missed": "all"}, "missed"),
        ({"name": "x", "playbook": "tests/api_hello", "every": 5, "paused": "yes"}, "paused"),
        ({"name": "x", "playbook": "tests/api_hello", "every": 5, "workload": [1]}, "workload"),
    ],
)
def test_a_bad_schedule_gets_400_naming_the_field(server, body, field):
    answer = server.post("/api/schedules", body)
    assert answer.status_code == 400, answer.text
    assert answer.json()["field"] == field
    assert answer.json()["detail"].startswith(f"{field}:")


def test_add_list_show_pause_resume_remove(server):
    body = {
        "name": "nightly",
        "playbook": "tests/api_hello",
        "cron": "0 3 * * *",
        "timezone": "Europe/Berlin",
        "workload": {"message": "scheduled"},
    }
    added = server.post("/api/schedules", body)
    assert added.status_code == 201, added.text
    item = added.json()
    assert (item["name"], item["cron"], item["timezone"], item["paused"]) == (
        "nightly",
        "0 3 * * *",
        "Europe/Berlin",
        False,
    )
    assert item["next_fire"].endswith("T02:00:00+00:00")  # 03:00 in Berlin, in UTC
    assert server.post("/api/schedules", body).status_code == 400  # exists
    assert server.post("/api/schedules", {**body, "replace": True, "cron": "30 4 * * *"}).status_code == 201
    listed = server.get("/api/schedules").json()["schedules"]
    assert [(s["name"], s["cron"]) for s in listed] == [("nightly", "30 4 * * *")]
    paused = server.post("/api/schedules/nightly/pause")
    assert paused.status_code == 200 and paused.json()["paused"] is True and paused.json()["next_fire"] is None
    shown = server.get("/api/schedules/nightly").json()
    assert shown["paused"] is True and shown["runs"] == [] and shown["workload"] == {"message": "scheduled"}
    assert server.post("/api/schedules/nightly/resume").json()["paused"] is False
    assert delete(server, "/api/schedules/nightly").status_code == 200
    assert server.get("/api/schedules/nightly").status_code == 404
    assert delete(server, "/api/schedules/nightly").status_code == 404
    assert server.post("/api/schedules/nightly/pause").status_code == 404


def test_the_dashboard_lists_the_schedules(server):
    body = {"name": "every-hour", "playbook": "tests/api_hello", "every": 3600, "workload": {"message": "hi"}}
    assert server.post("/api/schedules", body).status_code == 201
    assert server.post("/api/schedules", {**body, "name": "held", "paused": True}).status_code == 201
    try:
        page = server.get("/schedules")
        assert page.status_code == 200
        html = page.text
        assert 'id="schedules"' in html and '<a href="/schedules">schedules</a>' in html
        assert "<td>every-hour</td>" in html and "every 3600 s" in html and "tests/api_hello" in html
        assert "<td>held</td>" in html and ">paused</td>" in html and ">active</td>" in html
    finally:
        for name in ("every-hour", "held"):
            delete(server, f"/api/schedules/{name}")
    assert "no schedules" in server.get("/schedules").text


def test_a_browser_pauses_resumes_and_runs_a_schedule_now_with_the_token(tmp_path):
    """Headless Chromium with the dashboard's token (Basic credentials, as a browser caches them):
    the schedules page's pause, resume and run-now buttons; without the token the page offers
    none and a POST is refused."""
    import base64 as b64module

    from tests.support import browser
    from tests.support.services import ci_mode
    from tests.test_server import HELLO, TOKEN, Server

    try:
        driver = browser.chrome(str(tmp_path / "profile"))
    except browser.BrowserUnavailable as exc:
        (pytest.fail if ci_mode() else pytest.skip)(str(exc))
    from selenium.webdriver.common.by import By

    server = Server(tmp_path / "home", tmp_path / "server.log")
    try:
        assert server.register(HELLO).status_code == 200
        added = server.post("/api/schedules", {"name": "hourly", "playbook": "tests/api_hello", "every": 3600})
        assert added.status_code == 201, added.text
        plain = requests.get(server.url + "/schedules", timeout=30).text
        assert 'class="pause"' in plain  # the buttons are shown; the token is asked when pressed
        refused = requests.post(server.url + "/schedules/hourly/pause", timeout=30)
        assert refused.status_code in (401, 403), refused.text
        assert server.get("/api/schedules/hourly").json()["paused"] is False

        basic = "Basic " + b64module.b64encode(f"ops:{TOKEN}".encode()).decode()
        driver.execute_cdp_cmd("Network.enable", {})
        driver.execute_cdp_cmd("Network.setExtraHTTPHeaders", {"headers": {"Authorization": basic}})
        driver.get(server.url + "/schedules")

        def row():
            return driver.find_element(By.CSS_SELECTOR, 'tr.schedule[data-name="hourly"]')

        row().find_element(By.CSS_SELECTOR, "button.pause").click()
        until(lambda: row().get_attribute("data-state") == "paused")
        assert server.get("/api/schedules/hourly").json()["paused"] is True
        row().find_element(By.CSS_SELECTOR, "button.resume").click()
        until(lambda: row().get_attribute("data-state") == "active")
        assert server.get("/api/schedules/hourly").json()["paused"] is False
        row().find_element(By.CSS_SELECTOR, "button.run").click()
        until(lambda: "/executions/" in driver.current_url)
        execution_id = driver.current_url.rsplit("/", 1)[1]
        status = server.wait_end(execution_id)
        assert status["status"] == "completed" and status["playbook"] == "api_hello"
        driver.save_screenshot(str(tmp_path / "schedules.png"))
    finally:
        driver.quit()
        assert server.stop() == 0


def until(check, timeout: float = 15) -> None:
    """Until `check()` holds, read again while the page reloads (a form's POST and redirect)."""
    import time

    from selenium.common.exceptions import NoSuchElementException, StaleElementReferenceException

    deadline = time.monotonic() + timeout
    while True:
        try:
            if check():
                return
        except (NoSuchElementException, StaleElementReferenceException):
            pass
        assert time.monotonic() < deadline, "the page did not change"
        time.sleep(0.1)
