"""The execution dashboard over a real store: pages, live panel, JSON, masking, authentication,
and a real browser (headless Chromium) watching a loop run on real workers."""

from __future__ import annotations

import base64
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import requests

from noetl_celery.compiler import compile_playbook
from noetl_celery.dashboard import layout
from noetl_celery.runner import create_execution
from noetl_celery.store import views
from tests.support import browser
from tests.support.engines import cli
from tests.support.services import ci_mode, free_port, stop_process

REPO_ROOT = Path(__file__).resolve().parents[1]
PLAYBOOKS = Path(__file__).resolve().parent / "playbooks"
START_TIMEOUT = 30  # seconds for the dashboard to answer
TOKEN = "let-me-in"  # NOETL_DASHBOARD_TOKEN of the guarded dashboards
BASIC = {"Authorization": "Basic " + base64.b64encode(f"ops:{TOKEN}".encode()).decode()}
XSRF_FIELD = re.compile(r'<input type="hidden" name="_xsrf" value="([^"]+)"/>')


class Dashboard:
    """`noetl-celery dashboard` as a real process on a free loopback port."""

    def __init__(self, env: dict[str, str], log: Path):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        clean = {k: v for k, v in os.environ.items() if not k.startswith("NOETL_") or k.startswith("NOETL_TEST_")}
        self.log = log.open("w")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "noetl_celery.cli", "dashboard", "--port", str(self.port)],
            env={**clean, **env},
            cwd=REPO_ROOT,
            stdout=self.log,
            stderr=subprocess.STDOUT,
        )
        deadline = time.monotonic() + START_TIMEOUT
        while time.monotonic() < deadline:
            try:
                requests.get(self.url + "/", timeout=2)
                return
            except requests.ConnectionError:
                time.sleep(0.2)
        self.stop()
        raise AssertionError(f"dashboard did not answer on {self.url}: {log.read_text()}")

    def get(self, path: str, **kwargs) -> requests.Response:
        return requests.get(self.url + path, timeout=30, **kwargs)

    def stop(self) -> None:
        stop_process(self.proc)
        self.log.close()


def run_embedded(home: Path, playbook: str, *sets: str) -> int:
    proc = cli(["run", str(PLAYBOOKS / playbook), "--json", *sets], {"NOETL_HOME": str(home)})
    return int(json.loads(proc.stdout)["execution_id"])


@pytest.fixture
def embedded(tmp_path):
    """An embedded store with a failed loop execution and a dashboard over it."""
    home = tmp_path / "home"
    env = {
        "NOETL_HOME": str(home),
        "NOETL_FLOWER_URL": "http://flower.example:5555",
        "NOETL_AUTH_API_TOKEN": "s3cr3t-token-value",
    }
    failed = run_embedded(home, "loop_failures.yaml")
    dashboard = Dashboard(env, tmp_path / "dashboard.log")
    yield dashboard, failed
    dashboard.stop()


def test_pages_show_the_execution_its_failure_and_link_to_flower(embedded):
    dashboard, execution_id = embedded
    listing = dashboard.get("/?status=failed&playbook=loop_failures")
    assert listing.status_code == 200 and f"/executions/{execution_id}" in listing.text
    assert f"/executions/{execution_id}" not in dashboard.get("/?status=completed").text

    page = dashboard.get(f"/executions/{execution_id}")
    assert page.status_code == 200
    html = page.text
    assert 'data-step="strict" data-state="failed"' in html and 'data-step="start" data-state="completed"' in html
    assert 'data-step="after" data-state="pending"' in html  # never reached
    assert "failed step: strict" in html and "ZeroDivisionError" in html
    assert re.search(r'href="http://flower.example:5555/task/[0-9a-f-]{36}"', html)
    assert "cancel</button>" not in html and "resume</button>" not in html  # read-only without a token

    data = dashboard.get(f"/api/executions/{execution_id}").json()
    assert data["status"] == "failed" and data["steps"]["strict"]["state"] == "failed"
    # the rendered arguments of the failing attempt, and the loop element it ran for
    assert data["failure"]["iteration"] == 2 and data["failure"]["input"] == {"args": {"d": 0}}
    assert data["failure"]["element"] == 0
    assert [(loop["step"], loop["done"], loop["total"], loop["failed"]) for loop in data["loops"]] == [
        ("strict", 4, 4, 1)
    ]
    assert dashboard.get("/executions/12345").status_code == 404


def test_event_log_pages_and_filters(embedded):
    dashboard, execution_id = embedded
    first = dashboard.get(f"/executions/{execution_id}?event_type=iteration.completed")
    rows = re.findall(r"<tr class=\"ev\"><td>(\d+)</td>", first.text)
    assert len(rows) == 3 and "iteration.failed</td>" not in first.text
    after = dashboard.get(f"/executions/{execution_id}?event_type=iteration.completed&after={rows[0]}")
    assert re.findall(r"<tr class=\"ev\"><td>(\d+)</td>", after.text) == rows[1:]
    assert dashboard.get(f"/executions/{execution_id}?iteration=x").status_code == 400


@pytest.fixture
def guarded(tmp_path):
    """A dashboard with NOETL_DASHBOARD_TOKEN over an embedded store, and a way to add a running
    execution (created, never run: no workers)."""
    home = tmp_path / "home"
    home.mkdir(exist_ok=True)
    dashboard = Dashboard({"NOETL_HOME": str(home), "NOETL_DASHBOARD_TOKEN": TOKEN}, tmp_path / "guarded.log")

    def running() -> int:
        return create_execution(
            compile_playbook(str(PLAYBOOKS / "loop_many.yaml")), f"sqlite:///{home / 'noetl.sqlite'}"
        )

    yield dashboard, running
    dashboard.stop()


def status_of(dashboard: Dashboard, execution_id: int) -> str:
    return dashboard.get(f"/api/executions/{execution_id}").json()["status"]


def test_actions_need_the_token(embedded, guarded):
    dashboard, execution_id = embedded
    response = requests.post(f"{dashboard.url}/executions/{execution_id}/cancel", timeout=10)
    assert response.status_code == 403 and "read-only" in response.reason
    page = dashboard.get(f"/executions/{execution_id}")
    assert "_xsrf" not in page.text and "_xsrf" not in page.cookies  # read-only: no forms, no cookie

    guarded, new_running = guarded
    from noetl_celery.dashboard import actions

    assert "cancel" in actions.available()
    # as a browser: the page sets the _xsrf cookie and puts the matching token in its forms
    browser = requests.Session()
    page = browser.get(f"{guarded.url}/executions/{execution_id}", timeout=10)
    assert "resume</button>" in page.text and "cancel</button>" not in page.text  # failed
    token = XSRF_FIELD.search(page.text).group(1)
    assert "_xsrf" in browser.cookies
    url = f"{guarded.url}/executions/{execution_id}/cancel"
    anonymous = browser.post(url, data={"_xsrf": token}, timeout=10)
    assert anonymous.status_code == 401 and anonymous.headers["WWW-Authenticate"].startswith("Basic")
    wrong = browser.post(url, data={"_xsrf": token}, timeout=10, headers={"Authorization": "Basic b3BzOm5vcGU="})
    assert wrong.status_code == 401
    allowed = browser.post(url, data={"_xsrf": token}, timeout=10, headers=BASIC, allow_redirects=False)
    assert allowed.status_code == 302, allowed.text  # already failed: nothing to cancel

    # as a script: the Bearer token alone, no cookie, no xsrf token
    running = new_running()
    assert "cancel</button>" in guarded.get(f"/executions/{running}").text
    wrong_bearer = requests.post(
        f"{guarded.url}/executions/{running}/cancel", timeout=10, headers={"Authorization": "Bearer nope"}
    )
    assert wrong_bearer.status_code == 401 and status_of(guarded, running) == "running"
    cancelled = requests.post(
        f"{guarded.url}/executions/{running}/cancel",
        timeout=10,
        headers={"Authorization": f"Bearer {TOKEN}"},
        allow_redirects=False,
    )
    assert cancelled.status_code == 302
    assert status_of(guarded, running) == "cancelled"


def test_basic_auth_posts_need_the_pages_xsrf_token_and_origin(guarded):
    """Cached Basic credentials go with any site's POST: a forged one (no token, a wrong one, another
    origin) is refused; the dashboard page's own form or X-XSRFToken header is accepted."""
    guarded, new_running = guarded
    running = new_running()
    url = f"{guarded.url}/executions/{running}/cancel"
    browser = requests.Session()
    token = XSRF_FIELD.search(browser.get(f"{guarded.url}/executions/{running}", timeout=10).text).group(1)
    other = XSRF_FIELD.search(requests.get(f"{guarded.url}/executions/{running}", timeout=10).text).group(1)

    def post(session, data=None, **headers):
        return session.post(url, data=data, headers={**BASIC, **headers}, timeout=10, allow_redirects=False)

    refused = {
        "no token, no cookie": post(requests),
        "the cookie, no token (a forged form)": post(browser),
        "a token, no cookie": post(requests, {"_xsrf": token}),
        "another cookie's token": post(browser, {"_xsrf": other}),
        "a made-up token": post(browser, {"_xsrf": "2|00000000|deadbeef|1"}),
    }
    for case, response in refused.items():
        assert response.status_code == 403 and "XSRF token" in response.reason, (case, response.reason)
    cross_origin = {
        "Origin": post(browser, {"_xsrf": token}, Origin="http://evil.example"),
        "Origin of another port": post(browser, {"_xsrf": token}, Origin=f"http://127.0.0.1:{guarded.port + 1}"),
        "Origin null": post(browser, {"_xsrf": token}, Origin="null"),
        "Referer": post(browser, {"_xsrf": token}, Referer="http://evil.example/page"),
        "Sec-Fetch-Site cross-site": post(browser, {"_xsrf": token}, **{"Sec-Fetch-Site": "cross-site"}),
        "Sec-Fetch-Site same-site": post(browser, {"_xsrf": token}, **{"Sec-Fetch-Site": "same-site"}),
    }
    for case, response in cross_origin.items():
        assert response.status_code == 403 and "request refused" in response.reason, (case, response.reason)
    assert status_of(guarded, running) == "running"

    accepted = post(browser, {"_xsrf": token}, Origin=guarded.url, **{"Sec-Fetch-Site": "same-origin"})
    assert accepted.status_code == 302, accepted.reason
    assert status_of(guarded, running) == "cancelled"

    # the header a script on the page would send, behind a proxy that rewrites Host
    second = new_running()
    url = f"{guarded.url}/executions/{second}/cancel"
    proxied = post(
        browser,
        None,
        **{"X-XSRFToken": token, "Origin": "https://dash.example", "X-Forwarded-Host": "dash.example"},
    )
    assert proxied.status_code == 302, proxied.reason
    assert status_of(guarded, second) == "cancelled"


def test_secrets_are_masked_in_shown_values(monkeypatch):
    monkeypatch.setenv("NOETL_AUTH_API_TOKEN", "s3cr3t-token-value")
    shown = views.mask(
        {"headers": {"Authorization": "Bearer abc"}, "note": "uses s3cr3t-token-value", "password": "pw-1234", "n": 3}
    )
    assert shown == {"headers": {"Authorization": "***"}, "note": "uses ***", "password": "***", "n": 3}


def test_graph_layout_places_steps_by_distance_and_marks_states():
    plan = {
        "entry_step": "a",
        "steps": {
            "a": {"next": {"arcs": [{"step": "b"}, {"step": "c"}]}, "join": "d"},
            "b": {"next": {"arcs": [{"step": "d"}]}},
            "c": {"next": {"arcs": [{"step": "d"}]}},
            "d": {"next": {"arcs": []}, "loop": {"collection": "x"}},
        },
    }
    drawn = layout.graph(
        plan,
        {"a": {"state": "completed", "runs": 1}, "b": {"state": "running", "runs": 1}},
        [{"step": "d", "done": 3, "total": 9, "in_flight": 2}],
        [{"join_step": "d", "arrived": 1, "width": 2, "settled": 1}],
    )
    nodes = {n["name"]: n for n in drawn["nodes"]}
    assert nodes["a"]["x"] < nodes["b"]["x"] == nodes["c"]["x"] < nodes["d"]["x"]
    assert [nodes[n]["state"] for n in "abcd"] == ["completed", "running", "pending", "waiting"]
    assert nodes["d"]["loop"]["done"] == 3 and nodes["d"]["join"]["width"] == 2
    assert len(drawn["edges"]) == 4


def serve_directory(root: Path) -> tuple[subprocess.Popen, str]:
    """A static web server (another origin: another port of 127.0.0.1, which shares its cookies)."""
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "http.server", str(port), "--bind", "127.0.0.1", "--directory", str(root)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + START_TIMEOUT
    while time.monotonic() < deadline:
        try:
            requests.get(url + "/", timeout=2)
            return proc, url
        except requests.ConnectionError:
            time.sleep(0.2)
    proc.kill()
    raise AssertionError(f"http.server did not answer on {url}")


def wait_for(driver, text: str, timeout: float = 15) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        html = driver.page_source
        if text in html:
            return html
        time.sleep(0.2)
    raise AssertionError(f"{text!r} not in the page: {driver.page_source[:2000]}")


def test_a_browser_with_credentials_cancels_from_the_page_but_not_from_another_site(tmp_path, guarded):
    """A browser that sends the Basic credentials with every request (as one that has cached them)
    cancels with the page's button; another site's auto-submitted form, even with a planted
    _xsrf cookie and the matching field, changes nothing."""
    try:
        driver = browser.chrome(str(tmp_path / "profile"))
    except browser.BrowserUnavailable as exc:
        (pytest.fail if ci_mode() else pytest.skip)(str(exc))
    guarded, new_running = guarded
    target, mine = new_running(), new_running()
    site = tmp_path / "site"
    site.mkdir()
    (site / "attack.html").write_text(
        f'''<form method="post" action="{guarded.url}/executions/{target}/cancel">
<input type="hidden" name="_xsrf" value="planted"></form>
<script>document.cookie = "_xsrf=planted; path=/"; document.forms[0].submit();</script>'''
    )
    server, other_origin = serve_directory(site)
    try:
        driver.execute_cdp_cmd("Network.enable", {})
        driver.execute_cdp_cmd("Network.setExtraHTTPHeaders", {"headers": BASIC})
        driver.get(f"{other_origin}/attack.html")
        wait_for(driver, "403: cross-site request refused")
        assert status_of(guarded, target) == "running"

        driver.get(f"{guarded.url}/executions/{mine}")
        driver.find_element("css selector", "#summary form[action$='/cancel'] button").click()
        html = wait_for(driver, 'data-status="cancelled"')
        assert "resume</button>" in html and driver.current_url == f"{guarded.url}/executions/{mine}"
        assert status_of(guarded, mine) == "cancelled" and status_of(guarded, target) == "running"
    finally:
        driver.quit()
        server.terminate()
        server.wait(10)


def test_a_browser_watches_a_loop_run_to_its_end(tmp_path, redis_url, postgres_url, worker_factory):
    try:
        driver = browser.chrome(str(tmp_path / "profile"))
    except browser.BrowserUnavailable as exc:
        (pytest.fail if ci_mode() else pytest.skip)(str(exc))
    from noetl_celery.store.db import migrate

    migrate(postgres_url)
    env = {"NOETL_BROKER_URL": redis_url, "NOETL_DATABASE_URL": postgres_url}
    worker_factory(env=env, concurrency=2)
    dashboard = Dashboard(env, tmp_path / "dashboard.log")
    shots = tmp_path / "screenshots"
    shots.mkdir()
    try:
        # iterations 10-19 wait for the file hold.1, 20-29 for hold.2: each is made once the page has
        # shown a new count, so the loop cannot end before the browser has watched it move
        hold = tmp_path / "hold"
        sets = ["--set", "n=30", "--set", "sleep=0.25", "--set", f"hold={hold}", "--set", "hold_every=10"]
        proc = cli(["submit", str(PLAYBOOKS / "loop_many.yaml"), "--json", *sets], env)
        assert proc.returncode == 0, proc.stderr
        execution_id = int(json.loads(proc.stdout)["execution_id"])
        driver.get(f"{dashboard.url}/executions/{execution_id}")
        seen: list[tuple[int, int]] = []
        released = 0
        status = ""
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:
            html = driver.page_source
            status_match = re.search(r'id="status" class="s-\w+">(\w+)<', html)
            status = status_match.group(1) if status_match else ""
            count = re.search(r'class="loop-count">(\d+)/(\d+)<', html)
            if count and (not seen or seen[-1] != (int(count.group(1)), int(count.group(2)))):
                seen.append((int(count.group(1)), int(count.group(2))))
                driver.save_screenshot(str(shots / f"execution-{len(seen):02d}.png"))
            if status != "running":
                break
            if released < 2 and len(seen) > released:
                released += 1
                (tmp_path / f"hold.{released}").write_text("go")
            time.sleep(0.3)
        driver.save_screenshot(str(shots / "execution-final.png"))
        html = driver.page_source
        assert status == "completed", (status, seen)
        assert 'data-step="start"' in html and 'data-step="work" data-state="completed"' in html
        assert seen and seen[-1] == (30, 30), seen
        done_values = [d for d, _ in seen]
        assert len(seen) >= 3 and done_values == sorted(done_values) and done_values[0] < 30, seen
    finally:
        driver.quit()
        dashboard.stop()
        browser.ARTIFACTS.mkdir(exist_ok=True)
        for png in shots.glob("*.png"):
            shutil.copy(png, browser.ARTIFACTS / f"dashboard-{png.name}")


def test_a_browser_debugs_a_failed_step_and_navigates_many_executions(tmp_path):
    """Headless Chromium: a failed step outside any loop shows the rendered arguments its attempt
    got (secrets masked), its stdout, stderr and log records, and the execution's parameters; the
    executions list pages past 50 and a search by id finds an execution."""
    try:
        driver = browser.chrome(str(tmp_path / "profile"))
    except browser.BrowserUnavailable as exc:
        (pytest.fail if ci_mode() else pytest.skip)(str(exc))
    from selenium.webdriver.common.by import By

    secret = "s3cr3t-token-value"
    home = tmp_path / "home"
    env = {"NOETL_HOME": str(home), "NOETL_AUTH_API_TOKEN": secret}
    proc = cli(
        ["run", str(PLAYBOOKS / "debug_failure.yaml"), "--json", "--set", "divisor=0", "--set", f"note=uses {secret}"],
        env,
    )
    assert proc.returncode == 1, proc.stderr
    failed = int(json.loads(proc.stdout)["execution_id"])
    url = f"sqlite:///{home / 'noetl.sqlite'}"
    plan = compile_playbook(str(PLAYBOOKS / "loop_many.yaml"))
    others = [create_execution(plan, url) for _ in range(55)]  # 56 in all: two pages of 50
    dashboard = Dashboard(env, tmp_path / "dashboard.log")
    try:
        driver.get(f"{dashboard.url}/executions/{failed}")
        text = driver.find_element(By.ID, "failure-input").text
        shown = json.loads(text)
        assert shown == {"args": {"d": 0, "who": "hello world", "password": "***", "note": "uses ***"}}, text
        assert driver.find_element(By.ID, "failure-stdout").text == "computing with 0"
        assert driver.find_element(By.ID, "failure-stderr").text == "about to divide"
        assert driver.find_element(By.ID, "failure-log").text == "WARNING mine: divisor is 0"
        parameters = json.loads(driver.find_element(By.CSS_SELECTOR, "#parameters pre").text)
        assert parameters["divisor"] == 0 and parameters["note"] == "uses ***"
        attempt = driver.find_element(By.CSS_SELECTOR, "#attempts tr.attempt")
        attempt.find_element(By.CSS_SELECTOR, ".out-stderr summary").click()
        assert attempt.find_element(By.CSS_SELECTOR, ".out-stderr pre").text == "about to divide"
        assert secret not in driver.page_source and "pw-not-shown" not in driver.page_source
        driver.save_screenshot(str(tmp_path / "failed-step.png"))
        driver.find_element(By.ID, "latest").click()
        assert "execution.failed" in wait_for(driver, "execution.failed")

        driver.get(f"{dashboard.url}/")
        ids = lambda: [int(a.text) for a in driver.find_elements(By.CSS_SELECTOR, "#executions td:first-child a")]  # noqa: E731
        first_page = ids()
        assert len(first_page) == 50 and first_page[0] == others[-1]  # newest first
        driver.find_element(By.ID, "older").click()
        wait_for(driver, 'id="newest"')
        second_page = ids()
        assert sorted(first_page + second_page) == sorted([failed, *others])
        assert second_page[-1] == failed and not driver.find_elements(By.ID, "older")

        box = driver.find_element(By.CSS_SELECTOR, "#search input[name=q]")
        box.send_keys(str(others[7]))
        box.submit()
        wait_for(driver, f'value="{others[7]}"')
        assert ids() == [others[7]]
        driver.find_element(By.CSS_SELECTOR, "#executions td:first-child a").click()
        wait_for(driver, f"execution {others[7]}")
        assert driver.current_url == f"{dashboard.url}/executions/{others[7]}"
        listing = dashboard.get("/?playbook=EBUG_fail").text  # a part of the name, any case
        assert f"/executions/{failed}" in listing and f"/executions/{others[0]}" not in listing
        assert dashboard.get("/?q=nope").status_code == 400
    finally:
        driver.save_screenshot(str(tmp_path / "debugging.png"))
        driver.quit()
        dashboard.stop()
        browser.ARTIFACTS.mkdir(exist_ok=True)
        for png in ("debugging.png", "failed-step.png"):
            if (tmp_path / png).exists():
                shutil.copy(tmp_path / png, browser.ARTIFACTS / f"dashboard-{png}")


def test_a_browser_reads_the_run_history_grid_a_failed_bar_and_a_traceback_as_lines(tmp_path):
    """Headless Chromium: the run-history grid of a playbook (runs x steps, newest first, a cell per
    step coloured by its state, linking to the run); a failed execution's progress bar is red and
    not full; its traceback is shown as lines, not as an escaped JSON string."""
    try:
        driver = browser.chrome(str(tmp_path / "profile"))
    except browser.BrowserUnavailable as exc:
        (pytest.fail if ci_mode() else pytest.skip)(str(exc))
    from selenium.webdriver.common.by import By

    home = tmp_path / "home"
    env = {"NOETL_HOME": str(home)}
    completed = run_embedded(home, "debug_failure.yaml")
    proc = cli(["run", str(PLAYBOOKS / "debug_failure.yaml"), "--json", "--set", "divisor=0"], env)
    assert proc.returncode == 1, proc.stderr
    failed = int(json.loads(proc.stdout)["execution_id"])
    dashboard = Dashboard(env, tmp_path / "dashboard.log")
    try:
        driver.get(f"{dashboard.url}/executions/{failed}")
        driver.find_element(By.CSS_SELECTOR, "#summary h2 a").click()  # the playbook's name: its history
        wait_for(driver, 'id="history"')
        rows = driver.find_elements(By.CSS_SELECTOR, "#history tr.run")
        assert [int(r.get_attribute("data-execution")) for r in rows] == [failed, completed]  # newest first
        cells = [[c.get_attribute("data-state") for c in r.find_elements(By.CSS_SELECTOR, "td.cell")] for r in rows]
        assert cells == [["failed"], ["completed"]]
        colours = [
            driver.execute_script(
                "return getComputedStyle(arguments[0]).backgroundColor", r.find_element(By.CSS_SELECTOR, "td.cell")
            )
            for r in rows
        ]
        assert colours == ["rgb(214, 69, 69)", "rgb(46, 158, 91)"], colours
        driver.save_screenshot(str(tmp_path / "history.png"))
        rows[1].find_element(By.CSS_SELECTOR, "td.cell a").click()
        wait_for(driver, f"execution {completed}")
        full = driver.find_element(By.CSS_SELECTOR, "#progress-bar > span")
        assert full.get_attribute("style") == "width: 100%;"

        driver.get(f"{dashboard.url}/executions/{failed}")
        bar = driver.find_element(By.CSS_SELECTOR, "#progress-bar")
        inner = bar.find_element(By.CSS_SELECTOR, "span")
        assert inner.size["width"] < bar.size["width"], (inner.size, bar.size)
        red = driver.execute_script("return getComputedStyle(arguments[0]).backgroundColor", inner)
        assert red == "rgb(214, 69, 69)", red
        traceback = driver.find_element(By.ID, "failure-traceback").text
        lines = traceback.splitlines()
        assert lines[0] == "Traceback (most recent call last):" and lines[-1].startswith("ZeroDivisionError"), lines
        assert "\\n" not in traceback and "traceback" not in driver.find_element(By.ID, "failure-error").text
    finally:
        driver.quit()
        dashboard.stop()
