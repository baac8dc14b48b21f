"""Tests for the mock HTTP API (tests.support.mockapi), over real loopback HTTP."""

from __future__ import annotations

import base64
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import pytest
import requests

from tests.support.mockapi import TOTAL_ITEMS, MockServer, start_mock_api

TIMEOUT = 10


@pytest.fixture
def api() -> Iterator[MockServer]:
    with start_mock_api() as server:
        yield server


def get(api: MockServer, path: str, **params: object) -> requests.Response:
    return requests.get(f"{api.url}{path}", params=params, timeout=TIMEOUT)


def post(api: MockServer, path: str, **kwargs: object) -> requests.Response:
    return requests.post(f"{api.url}{path}", timeout=TIMEOUT, **kwargs)  # type: ignore[arg-type]


def b64(page: int) -> str:
    return base64.b64encode(str(page).encode()).decode()


# -- server lifecycle --------------------------------------------------------------------------


def test_health_and_url(api: MockServer) -> None:
    assert api.url.startswith("http://127.0.0.1:") and api.port > 0
    resp = get(api, "/health")
    assert resp.status_code == 200
    assert resp.headers["Content-Type"] == "application/json"
    assert resp.json() == {"status": "ok"}


def test_stop_is_quick_and_frees_the_port() -> None:
    server = start_mock_api()
    url = server.url
    assert requests.get(f"{url}/health", timeout=TIMEOUT).ok
    started = time.monotonic()
    server.stop()
    assert time.monotonic() - started < 2
    with pytest.raises(requests.ConnectionError):
        requests.get(f"{url}/health", timeout=2)


def test_stop_does_not_wait_for_sleeping_requests() -> None:
    server = start_mock_api()
    pool = ThreadPoolExecutor(max_workers=1)
    pool.submit(requests.get, f"{server.url}/api/v1/concurrency/probe", params={"delay_seconds": 3}, timeout=TIMEOUT)
    time.sleep(0.2)
    started = time.monotonic()
    server.stop()
    assert time.monotonic() - started < 2
    pool.shutdown(wait=False)


def test_unknown_path_and_method(api: MockServer) -> None:
    resp = get(api, "/api/v1/nope")
    assert resp.status_code == 404
    assert resp.json()["status"] == 404 and "error" in resp.json()
    resp = requests.delete(f"{api.url}/api/v1/assessments", timeout=TIMEOUT)
    assert resp.status_code == 405 and resp.json()["status"] == 405


def test_bad_number_is_400(api: MockServer) -> None:
    resp = get(api, "/api/v1/assessments", page="abc")
    assert resp.status_code == 400 and resp.json()["status"] == 400


# -- page-number pagination -------------------------------------------------------------------


def test_assessments_pages_cover_all_ids_in_order(api: MockServer) -> None:
    ids: list[int] = []
    page, pages = 1, 0
    while True:
        body = get(api, "/api/v1/assessments", page=page, pageSize=10).json()
        pages += 1
        ids += [item["id"] for item in body["data"]]
        assert set(body["data"][0]) == {"id", "name", "score"}
        assert body["paging"]["page"] == page and body["paging"]["pageSize"] == 10
        assert body["paging"]["total"] == TOTAL_ITEMS
        if not body["paging"]["hasMore"]:
            break
        page += 1
    assert ids == list(range(1, 36)) and pages == 4


def test_assessments_default_size_page_size_alias_and_past_end(api: MockServer) -> None:
    body = get(api, "/api/v1/assessments").json()
    assert len(body["data"]) == 10 and body["paging"] == {"hasMore": True, "page": 1, "pageSize": 10, "total": 35}
    body = get(api, "/api/v1/assessments", page=2, page_size=20).json()
    assert [i["id"] for i in body["data"]] == list(range(21, 36)) and body["paging"]["hasMore"] is False
    body = get(api, "/api/v1/assessments", page=9, pageSize=10).json()
    assert body["data"] == [] and body["paging"]["hasMore"] is False


def test_assessments_accepts_post(api: MockServer) -> None:
    body = post(api, "/api/v1/assessments", json={"page": 2, "pageSize": 15}).json()
    assert [i["id"] for i in body["data"]] == list(range(16, 31))


# -- offset pagination ------------------------------------------------------------------------


def test_users_offset_limit(api: MockServer) -> None:
    ids: list[int] = []
    offset = 0
    while True:
        body = get(api, "/api/v1/users", offset=offset, limit=10).json()
        assert body["offset"] == offset and body["limit"] == 10 and body["total"] == 35
        assert "paging" not in body
        ids += [u["id"] for u in body["users"]]
        if not body["has_more"]:
            break
        offset += body["limit"]
    assert ids == list(range(1, 36))
    assert set(body["users"][0]) == {"id", "username", "email"}
    past = get(api, "/api/v1/users", offset=40, limit=10).json()
    assert past["users"] == [] and past["has_more"] is False


def test_users_page_style_like_loop_with_pagination(api: MockServer) -> None:
    ids: list[int] = []
    page = 1
    while True:
        body = get(api, "/api/v1/users", page=page, pageSize=15).json()
        assert body["data"] == body["users"]
        assert body["paging"]["page"] == page and body["paging"]["pageSize"] == 15
        assert body["offset"] == (page - 1) * 15 and body["limit"] == 15
        ids += [u["id"] for u in body["data"]]
        if not body["paging"]["hasMore"]:
            break
        page += 1
    assert ids == list(range(1, 36)) and page == 3


# -- cursor pagination ------------------------------------------------------------------------


def test_events_cursor_walk(api: MockServer) -> None:
    ids: list[int] = []
    cursor: str | None = ""
    while cursor is not None:
        body = get(api, "/api/v1/events", cursor=cursor, limit=10).json()
        assert body["limit"] == 10
        ids += [e["id"] for e in body["events"]]
        cursor = body["next_cursor"]
    assert ids == list(range(1, 36))
    assert {"id", "type"} <= set(body["events"][0])


def test_events_cursor_values(api: MockServer) -> None:
    first = get(api, "/api/v1/events").json()
    assert first["next_cursor"] == b64(2) and [e["id"] for e in first["events"]] == list(range(1, 11))
    for bad in ("", "!!!not-base64", base64.b64encode(b"abc").decode()):
        body = get(api, "/api/v1/events", cursor=bad, limit=10).json()
        assert body["events"] == first["events"]
    last = get(api, "/api/v1/events", cursor=b64(4), limit=10).json()
    assert [e["id"] for e in last["events"]] == list(range(31, 36)) and last["next_cursor"] is None
    past = get(api, "/api/v1/events", cursor=b64(7), limit=10).json()
    assert past["events"] == [] and past["next_cursor"] is None


# -- flaky ------------------------------------------------------------------------------------


def test_flaky_fails_first_attempt_only(api: MockServer) -> None:
    ok = get(api, "/api/v1/flaky", page=1, fail_on="2,3")
    assert ok.status_code == 200
    assert set(ok.json()["paging"]) >= {"hasMore", "page", "pageSize"}
    for page in (2, 3):
        first = get(api, "/api/v1/flaky", page=page, fail_on="2,3")
        assert first.status_code == 500 and first.json()["status"] == 500
        again = get(api, "/api/v1/flaky", page=page, fail_on="2,3")
        assert again.status_code == 200
        assert [i["id"] for i in again.json()["data"]][0] == (page - 1) * 10 + 1
    last = get(api, "/api/v1/flaky", page=4, fail_on="2,3").json()
    assert last["paging"]["hasMore"] is False and len(last["data"]) == 5


def test_flaky_reset_and_per_instance_state(api: MockServer) -> None:
    assert get(api, "/api/v1/flaky", page=1, fail_on="1").status_code == 500
    assert get(api, "/api/v1/flaky", page=1, fail_on="1").status_code == 200
    assert post(api, "/api/v1/flaky/reset").status_code == 200
    assert get(api, "/api/v1/flaky", page=1, fail_on="1").status_code == 500
    api.state.reset()
    assert get(api, "/api/v1/flaky", page=1, fail_on="1").status_code == 500
    with start_mock_api() as other:
        assert get(other, "/api/v1/flaky", page=1, fail_on="1").status_code == 500


def test_flaky_pagination_with_retry_collects_35(api: MockServer) -> None:
    items: list[dict[str, object]] = []
    page, failures = 1, 0
    while True:
        resp = get(api, "/api/v1/flaky", page=page, fail_on="2")
        if resp.status_code == 500:
            failures += 1
            continue
        body = resp.json()
        items += body["data"]
        if not body["paging"]["hasMore"]:
            break
        page += 1
    assert failures == 1 and [i["id"] for i in items] == list(range(1, 36))


# -- errors -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("error_type", "status", "retry_after"),
    [
        ("rate_limit", 429, "5"),
        ("429", 429, "5"),
        ("server_error", 500, None),
        ("500", 500, None),
        ("unavailable", 503, "5"),
        ("503", 503, "5"),
        ("auth", 401, None),
        ("401", 401, None),
        ("forbidden", 403, None),
        ("403", 403, None),
        ("not_found", 404, None),
        ("404", 404, None),
    ],
)
def test_errors_endpoint(api: MockServer, error_type: str, status: int, retry_after: str | None) -> None:
    resp = get(api, "/api/v1/errors", error_type=error_type)
    assert resp.status_code == status
    assert resp.json()["status"] == status and resp.json()["error"]
    assert resp.headers.get("Retry-After") == retry_after


def test_errors_retry_after_param(api: MockServer) -> None:
    assert get(api, "/api/v1/errors", error_type="rate_limit", retry_after=2).headers["Retry-After"] == "2"
    assert get(api, "/api/v1/errors", error_type="503", retry_after=7).headers["Retry-After"] == "7"


def test_errors_timeout_sleeps_then_answers(api: MockServer) -> None:
    for name in ("delay", "timeout_seconds"):
        started = time.monotonic()
        resp = get(api, "/api/v1/errors", error_type="timeout", **{name: 0.3})
        assert resp.status_code == 200 and len(resp.json()["data"]) == 10
        assert 0.3 <= time.monotonic() - started < 3
    with pytest.raises(requests.Timeout):
        requests.get(f"{api.url}/api/v1/errors", params={"error_type": "timeout", "delay": 2}, timeout=0.3)


def test_errors_unknown_type_is_normal_page(api: MockServer) -> None:
    for params in ({}, {"error_type": "none"}):
        resp = get(api, "/api/v1/errors", **params)
        assert resp.status_code == 200 and [i["id"] for i in resp.json()["data"]] == list(range(1, 11))


# -- rate limit -------------------------------------------------------------------------------


def test_rate_limited_window(api: MockServer) -> None:
    codes = []
    for _ in range(3):
        resp = get(api, "/api/v1/rate-limited", requests_per_second=2)
        codes.append(resp.status_code)
        if resp.status_code == 200:
            assert resp.json()["rate_limit"]["limit"] == 2 and len(resp.json()["data"]) == 10
    assert codes == [200, 200, 429]
    assert int(resp.headers["Retry-After"]) >= 1
    assert resp.json()["requests_in_window"] == 2 and resp.json()["limit"] == 2 and resp.json()["error"]
    time.sleep(1.05)
    resp = get(api, "/api/v1/rate-limited", requests_per_second=2, page=2)
    assert resp.status_code == 200 and resp.json()["rate_limit"] == {"limit": 2, "requests_in_window": 1}
    assert resp.json()["paging"]["page"] == 2


# -- concurrency probe ------------------------------------------------------------------------


def _probe_many(api: MockServer, count: int, workers: int) -> list[dict[str, object]]:
    def one(i: int) -> dict[str, object]:
        resp = get(api, "/api/v1/concurrency/probe", delay_seconds=0.5, i=i)
        assert resp.status_code == 200
        return resp.json()

    with ThreadPoolExecutor(max_workers=workers) as pool:
        return list(pool.map(one, range(count)))


def test_probe_counts_overlap(api: MockServer) -> None:
    bodies = _probe_many(api, 5, 5)
    assert sorted(b["params"]["i"] for b in bodies) == ["0", "1", "2", "3", "4"]  # type: ignore[index]
    stats = get(api, "/api/v1/concurrency/stats").json()
    assert stats["max_active"] == 5 and stats["total"] == 5
    assert get(api, "/api/v1/concurrency/probe/stats").json()["max_active"] == 5


def test_probe_respects_client_cap_and_reset(api: MockServer) -> None:
    _probe_many(api, 6, 2)
    assert get(api, "/api/v1/concurrency/probe/stats").json()["max_active"] == 2
    assert post(api, "/api/v1/concurrency/reset").status_code == 200
    assert get(api, "/api/v1/concurrency/stats").json()["max_active"] == 0
    _probe_many(api, 3, 1)
    assert get(api, "/api/v1/concurrency/stats").json() | {"active": 0} == {"max_active": 1, "total": 3, "active": 0}
    assert post(api, "/api/v1/concurrency/probe/reset").json()["total"] == 0
    assert api.state.concurrency_stats()["total"] == 0


# -- patient endpoints ------------------------------------------------------------------------


@pytest.mark.parametrize("data_type", ["assessments", "conditions", "medications", "vital_signs"])
def test_patient_pages_deterministic(api: MockServer, data_type: str) -> None:
    path = f"/api/v1/patient/{data_type}"
    for patient_id in (1, 2, 3, 42):
        first = get(api, path, patientId=patient_id, page=1, pageSize=5).json()
        total = first["paging"]["total"]
        assert 1 <= total <= 4 and first["data"]
        assert get(api, path, patientId=patient_id, page=1).json()["paging"]["total"] == total
        for page in range(1, total + 1):
            body = get(api, path, patientId=patient_id, page=page).json()
            assert body["paging"]["hasMore"] == (page < total) and body["paging"]["page"] == page
        past = get(api, path, patientId=patient_id, page=total + 1)
        assert past.status_code == 404 and past.json()["status"] == 404


def test_patient_page_counts_vary_and_need_patient_id(api: MockServer) -> None:
    totals = {
        (t, p): get(api, f"/api/v1/patient/{t}", patientId=p).json()["paging"]["total"]
        for t in ("assessments", "conditions", "medications", "vital_signs")
        for p in range(1, 5)
    }
    assert len(set(totals.values())) > 1
    assert get(api, "/api/v1/patient/conditions").status_code == 400
    assert get(api, "/api/v1/patient/unknown", patientId=1).status_code == 404


# -- command line -----------------------------------------------------------------------------


def test_module_runs_in_foreground() -> None:
    proc = subprocess.Popen(
        [sys.executable, "-m", "tests.support.mockapi", "--host", "127.0.0.1", "--port", "0"],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        url = line.strip().split()[-1]
        assert url.startswith("http://127.0.0.1:")
        assert requests.get(f"{url}/health", timeout=TIMEOUT).json() == {"status": "ok"}
    finally:
        proc.terminate()
        proc.wait(timeout=TIMEOUT)
