"""Cursor loops on real worker processes: NoETL's page-continuation flow on two workers against the
mock API, and a worker SIGKILLed in the middle of a 1,000-row loop on each cursor driver's real
server (PostgreSQL, Redis stream, MariaDB/MySQL, NATS JetStream)."""

from __future__ import annotations

import contextlib
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import text

from noetl_celery.runner import wait
from noetl_celery.store.db import get_engine
from tests.support import services as svc
from tests.support.corpus import CORPUS
from tests.support.engines import submit
from tests.support.mockapi import PATIENT_MAX_PAGES, PATIENT_PAGE_MULTIPLIER, PATIENT_TYPE_OFFSETS, start_mock_api

ROOT = Path(__file__).resolve().parents[2]
PAGE_CONTINUATION = CORPUS / "cursor" / "pft_page_continuation.yaml"
RUN_TIMEOUT = 600  # seconds one execution may take on a loaded machine


@pytest.fixture
def pg_env(env, pg_dsn) -> dict[str, str]:
    return {**env, "NOETL_AUTH_PG_K8S": pg_dsn}


def events(url: str, execution_id: int, step: str) -> list[dict]:
    with get_engine(url).connect() as conn:
        rows = conn.execute(
            text(
                "SELECT event_type, meta, task, status, worker FROM noetl_event WHERE execution_id = :x AND step = :s"
            ),
            {"x": execution_id, "s": step},
        )
        return [dict(r._mapping) for r in rows]


def expected_pages(patients: int) -> dict[tuple[str, str, int], int]:
    return {
        (dt, str(p), page): 1
        for dt, off in PATIENT_TYPE_OFFSETS.items()
        for p in range(1, patients + 1)
        for page in range(1, 2 + (p * PATIENT_PAGE_MULTIPLIER + off) % PATIENT_MAX_PAGES)
    }


@pytest.mark.skipif(not PAGE_CONTINUATION.exists(), reason="NoETL corpus not available")
def test_pft_page_continuation_on_two_workers_fetches_every_page_once(pg_env, store_url, worker_factory):
    # without eager attempts: the loop has one slot, whose rows and pages would otherwise go on
    # in the job that decided them, on one worker; each goes through the broker here, so both
    # workers take part and each continues what the other recorded
    worker_env = {**pg_env, "NOETL_EAGER_WINDOW": "0"}
    nodes = [worker_factory(env=worker_env, concurrency=2, name=f"pft-{n}@%h") for n in "ab"]
    with start_mock_api() as api:
        execution_id = submit(pg_env, PAGE_CONTINUATION, api_url=api.url)
        status = wait(store_url, execution_id, timeout=RUN_TIMEOUT)
        hits = dict(api.state.patient_hits)
    assert status["status"] == "completed", status.get("error")
    # the playbook's own verification step passed
    # its DO block and its SELECT: stored as NoETL numbers statements, the SELECT's rows last
    verified = status["results"]["verify_pages"]
    verdict = verified[f"command_{verified['statement_count'] - 1}"]["rows"][0]
    assert verdict["status"] == "passed"
    expected = expected_pages(10)
    assert hits == expected  # every (data type, patient, page) requested exactly once
    assert verdict["records_fetched"] == len(expected)
    assert status["results"]["fetch_pages"] == {"stats": {"processed": len(expected), "failed": 0, "slots": 1}}
    kinds = Counter(e["event_type"] for e in events(store_url, execution_id, "fetch_pages"))
    assert kinds["cursor.item.done"] == len(expected) and kinds["iterator.completed"] == 1
    seen = {e["worker"] for e in events(store_url, execution_id, "fetch_pages")}
    assert {node.node for node in nodes} <= seen, seen  # both worker nodes ran part of the loop


def republished(url: str, execution_id: int) -> list[dict]:
    """The sweeper's re-sent attempts (step, task, attempt, iteration) of an execution."""
    with get_engine(url).connect() as conn:
        rows = conn.execute(
            text(
                "SELECT step, task, attempt, iteration FROM noetl_event "
                "WHERE execution_id = :x AND event_type = 'attempt.republished'"
            ),
            {"x": execution_id},
        )
        return [dict(r._mapping) for r in rows]


PFT_FLOW = CORPUS / "cursor" / "pft_flow.yaml"


@pytest.mark.slow
@pytest.mark.skipif(not PFT_FLOW.exists(), reason="NoETL corpus not available")
def test_pft_flow_with_mds_batch_sub_playbooks_on_two_workers(pg_env, store_url, worker_factory, tmp_path):
    # the MDS batch worker is found beside pft_flow.yaml by its metadata.path
    for n in "ab":
        worker_factory(env=pg_env, concurrency=2, name=f"flow-{n}@%h")
    with start_mock_api() as api:
        execution_id = submit(
            pg_env, PFT_FLOW, api_url=api.url, num_facilities=1, patients_per_facility=20, claim_batch_size=20
        )
        status = wait(store_url, execution_id, timeout=RUN_TIMEOUT)
        hits, mds_hits = dict(api.state.patient_hits), dict(api.state.mds_hits)
    # on failure, say what happened: the outcome and any attempt the sweeper had to send again
    why = {
        "status": status["status"],
        "failed_step": status.get("failed_step"),
        "error": (status.get("error") or {}).get("message", "")[:2000],
        "republished": republished(store_url, execution_id),
        "repeated_hits": [k for k, v in hits.items() if v > 1][:10],
    }
    # The flow's own validation log: every data type done for every one of the 20 patients (its
    # total_expected is written as a literal 1000 by the playbook).
    assert "validate_all_results" in status["results"], why
    validation = status["results"]["validate_all_results"]["rows"]
    assert validation == [
        {
            **validation[0],
            "facility_mapping_id": 1,
            "assessments_done": 20,
            "conditions_done": 20,
            "medications_done": 20,
            "vital_signs_done": 20,
            "demographics_done": 20,
            "assessments_queue_done": 20,
        }
    ]
    # Its last step hard-codes the full size too (10 facilities of 1000 patients, literal args),
    # so at this size it fails on exactly those counts and on nothing else.
    assert status["failed_step"] == "check_results", why
    assert "Patient loss detected" in status["error"]["message"], why
    assert status["error"]["message"].count("=20 (expected 1000)") == 5, why
    assert "Expected 10 facilities in log, got 1" in status["error"]["message"], why
    assert "RACE BUG" not in status["error"]["message"], why
    assert hits and max(hits.values()) == 1, why
    assert {k[0] for k in hits} == {"assessments", "conditions", "medications", "vital_signs", "demographics"}
    assert mds_hits and max(mds_hits.values()) == 1, (why, [k for k, v in mds_hits.items() if v > 1][:10])
    assert status["children"] and {c["status"] for c in status["children"]} == {"completed"}, status["children"]


# --- a worker SIGKILLed in the middle of a 1,000-row cursor loop, on each driver's real server

POISON = 3  # entries a vanished consumer already took `max_deliveries` times (mysql, redis_stream, nats)
ROWS = 1000  # rows of each loop; the victim is killed once KILL_AFTER of them are done
KILL_AFTER = 150


@dataclass
class Queue:
    """One driver's work queue for the loop: the playbook, its workload, how a row names its
    number, and what the playbook's `verify` step must read back."""

    playbook: Path
    workload: dict[str, Any]
    number: Callable[[dict], int]
    verify: Any
    env: dict[str, str] = field(default_factory=dict)


@contextlib.contextmanager
def postgres_queue(request) -> Iterator[Queue]:
    pg_dsn = request.getfixturevalue("pg_dsn")
    yield Queue(
        ROOT / "tests" / "playbooks" / "cursor_rows_pg.yaml",
        {},
        lambda row: int(row["id"]),
        {"rows": [{"done": ROWS, "open": 0}]},
        env={"NOETL_AUTH_PG_K8S": pg_dsn},
    )


@contextlib.contextmanager
def redis_stream_queue(request) -> Iterator[Queue]:
    redis_url = request.getfixturevalue("redis_url")
    yield Queue(
        ROOT / "tests" / "playbooks" / "cursor_rows_redis.yaml",
        {"redis_url": redis_url, "stream": f"test:cursor_rows:{time.time_ns()}", "poison": POISON},
        lambda row: int(row["n"]),
        {"done": ROWS, "pending": 0, "dead": list(range(-POISON, 0))},
    )


@contextlib.contextmanager
def mysql_queue(request) -> Iterator[Queue]:
    with svc.fresh_mysql_database(svc.mysql_server_url()) as url:
        yield Queue(
            ROOT / "tests" / "playbooks" / "cursor_rows_mysql.yaml",
            {"mysql_url": url, "poison": POISON},
            lambda row: int(row["n"]),
            {"done": ROWS, "open": 0, "dead": list(range(-POISON, 0))},
        )


@contextlib.contextmanager
def nats_queue(request) -> Iterator[Queue]:
    import asyncio

    import nats

    url = svc.nats_server_url()
    tag = uuid.uuid4().hex[:10]
    stream, bucket = f"T{tag}", f"kv_{tag}"

    async def on_js(fn: Callable[[Any], Any]) -> None:
        nc = await nats.connect(url)
        try:
            await fn(nc.jetstream())
        finally:
            await nc.close()

    async def drop(js: Any) -> None:
        for name in (stream, f"{stream}_DEAD", f"KV_{bucket}"):
            with contextlib.suppress(Exception):  # one the run did not create
                await js.delete_stream(name)

    asyncio.run(on_js(lambda js: js.create_key_value(bucket=bucket)))
    try:
        yield Queue(
            ROOT / "tests" / "playbooks" / "cursor_rows_nats.yaml",
            {"nats_url": url, "stream": stream, "bucket": bucket, "poison": POISON},
            lambda row: int(row["data"]["n"]),
            {"done": ROWS, "unacked": 0, "pending": 0, "dead": list(range(-POISON, 0))},
        )
    finally:
        asyncio.run(on_js(drop))


QUEUES = {"postgres": postgres_queue, "redis_stream": redis_stream_queue, "mysql": mysql_queue, "nats": nats_queue}


def item_numbers(url: str, execution_id: int, number: Callable[[dict], int]) -> Counter:
    return Counter(
        number(e["meta"]["row"]) for e in events(url, execution_id, "drain") if e["event_type"] == "cursor.item.done"
    )


@pytest.mark.parametrize(
    "driver",
    [
        "postgres",
        pytest.param("redis_stream", marks=pytest.mark.slow),
        pytest.param("mysql", marks=pytest.mark.slow),
        pytest.param("nats", marks=pytest.mark.slow),
    ],
)
def test_a_worker_killed_mid_cursor_loop_loses_no_row_and_repeats_none(request, driver, env, store_url, worker_factory):
    """1,000 rows, 8 slots, two workers; the victim is SIGKILLed once 150 rows are done. Every row
    is done once (one cursor.item.done row each), loop.done comes once, all 8 slots end, and the
    poison entries (mysql, redis_stream, nats) are dead-lettered, never run."""
    with QUEUES[driver](request) as queue:
        run_env = {**env, **queue.env}
        worker_env = {**run_env, "NOETL_VISIBILITY_TIMEOUT": "8", "NOETL_RESTORE_INTERVAL": "2"}
        victim = worker_factory(env=worker_env, concurrency=2, name="victim@%h")
        worker_factory(env=worker_env, concurrency=2, name="survivor@%h")
        execution_id = submit(run_env, queue.playbook, rows=ROWS, row_sleep=0.005, **queue.workload)
        deadline = time.monotonic() + RUN_TIMEOUT
        done = 0
        while time.monotonic() < deadline:
            done = sum(item_numbers(store_url, execution_id, queue.number).values())
            if done >= KILL_AFTER:
                break
            time.sleep(0.2)
        assert KILL_AFTER <= done < ROWS, f"{done} rows done before the kill"
        victim.kill()
        status = wait(store_url, execution_id, timeout=RUN_TIMEOUT)
        assert status["status"] == "completed", status.get("error")
        numbers = item_numbers(store_url, execution_id, queue.number)
        expected = set(range(1, ROWS + 1))
        assert set(numbers) == expected, (
            f"missing: {sorted(expected - set(numbers))[:10]}, extra: {sorted(set(numbers) - expected)[:10]}"
        )
        assert max(numbers.values()) == 1, [n for n, c in numbers.items() if c > 1][:10]
        kinds = Counter(e["event_type"] for e in events(store_url, execution_id, "drain"))
        assert kinds["iterator.completed"] == 1  # loop.done once
        assert kinds["cursor.slot.ended"] == 8
        assert status["results"]["drain"] == {"stats": {"processed": ROWS, "failed": 0, "slots": 8}}
        verify = status["results"]["verify"]
        assert {k: verify[k] for k in queue.verify} == queue.verify, verify


@pytest.mark.slow
def test_a_nats_claim_killed_between_its_pull_and_its_record_loses_no_row(
    request, env, store_url, worker_factory, tmp_path
):
    """The worker process of a nats claim is SIGKILLed right after its pull, before the slot's
    record of the messages it took (tests/support/lost_pull_app.py): they stay delivered and
    unacknowledged, named by no record, until AckWait (6 s here). 8 rows, 2 slots of 4: the claim
    run again finds the stream empty, the other slot ends; the loop must not complete without
    them. The slot claims again (`cursor.claim.waiting`) until they come back, and runs them."""
    rows, ack_wait = 8, 6
    mark = tmp_path / "killed"
    with nats_queue(request) as queue:
        playbook = tmp_path / "cursor_rows_nats_2.yaml"
        text_ = queue.playbook.read_text()
        assert "max_in_flight: 8\n" in text_
        playbook.write_text(text_.replace("max_in_flight: 8\n", "max_in_flight: 2\n"))
        worker_env = {**env, "NOETL_TEST_LOST_PULL_MARK": str(mark)}
        worker = worker_factory(app="tests.support.lost_pull_app", env=worker_env, concurrency=2, name="lost-pull@%h")
        workload = {**queue.workload, "poison": 0, "ack_wait": ack_wait}
        execution_id = submit(env, playbook, rows=rows, row_sleep=0.005, **workload)
        status = wait(store_url, execution_id, timeout=RUN_TIMEOUT)
        assert mark.exists(), f"no claim was killed after its pull:\n{worker.log_tail()}"
        assert "killed its worker process" in worker.log_text(), worker.log_tail()
        assert status["status"] == "completed", status.get("error")
        numbers = item_numbers(store_url, execution_id, queue.number)
        assert sorted(numbers) == list(range(1, rows + 1)) and max(numbers.values()) == 1, numbers
        drained = events(store_url, execution_id, "drain")
        kinds = Counter(e["event_type"] for e in drained)
        assert kinds["cursor.claim.waiting"] >= 1 and kinds["cursor.slot.ended"] == 2, kinds
        again = [
            e["meta"]["row"]
            for e in drained
            if e["event_type"] == "cursor.item.done" and e["meta"]["row"]["deliveries"] > 1
        ]
        assert len(again) == 4, again  # the lost pull's frame, delivered a second time
        verify = status["results"]["verify"]
        assert {k: verify[k] for k in ("done", "unacked", "pending", "dead")} == {
            "done": rows,
            "unacked": 0,
            "pending": 0,
            "dead": [],
        }, verify
