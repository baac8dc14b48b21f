"""The mysql cursor driver on the machine's MariaDB/MySQL (a database of each test's own): the
claim contract (row or nothing, take back, lease, dead letter, done) and a loop run in-process."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from noetl_celery import cursors
from noetl_celery.cursors import SLOT_PARAM, ClaimCall
from tests.support import services as svc
from tests.support.harness import run_playbook

ROOT = Path(__file__).resolve().parents[1]
ROWS = ROOT / "tests" / "playbooks" / "cursor_rows_mysql.yaml"
TABLE = """
CREATE TABLE work (
  id INT PRIMARY KEY, n INT NOT NULL, note VARCHAR(40) NULL,
  status VARCHAR(16) NOT NULL DEFAULT 'pending', claimed_by VARCHAR(255) NULL,
  claimed_at DATETIME(6) NULL, attempts INT NOT NULL DEFAULT 0)
"""


@pytest.fixture
def mysql_url() -> Iterator[str]:
    with svc.fresh_mysql_database(svc.mysql_server_url()) as url:
        svc.mysql_query(url, TABLE)
        yield url


def claim(
    url: str, slot: str = "run:0", done: list[Any] | None = None, lease: float = 60, rows: int = 1, **options: Any
) -> Any:
    call = ClaimCall(
        sql="",
        params={SLOT_PARAM: slot},
        credential={"url": url},
        timeout=lease,
        options={"table": "work", **options},
        done=done or [],
        max_rows=rows,
    )
    outcome = cursors.claim("mysql", call)
    assert outcome.status == "ok", outcome.error
    return outcome.data["rows"]


def state(url: str) -> dict[int, tuple[str, str | None, int]]:
    rows = svc.mysql_query(url, "SELECT id, status, claimed_by, attempts FROM work")
    return {r["id"]: (r["status"], r["claimed_by"], r["attempts"]) for r in rows}


def age(url: str, row_id: int, seconds: int = 600) -> None:
    """Make a claim look `seconds` old (its slot gone, past any lease)."""
    svc.mysql_query(url, "UPDATE work SET claimed_at = NOW(6) - INTERVAL %s SECOND WHERE id = %s", (seconds, row_id))


def test_row_or_nothing_take_back_lease_done_and_dead_letter(mysql_url: str) -> None:
    assert claim(mysql_url) == []  # an empty table ends the slot
    svc.mysql_query(mysql_url, "INSERT INTO work (id, n, note) VALUES (1, 10, 'a'), (2, 20, NULL)")

    (row,) = claim(mysql_url, slot="run:0")
    assert {k: row[k] for k in ("id", "n", "note", "status", "claimed_by", "attempts")} == {
        "id": 1,
        "n": 10,
        "note": "a",
        "status": "claimed",
        "claimed_by": "run:0",
        "attempts": 1,
    }
    assert isinstance(row["claimed_at"], str)  # a datetime, as ISO text
    # the slot's claim died before the engine recorded it: the slot's next claim takes it back
    (again,) = claim(mysql_url, slot="run:0")
    assert (again["id"], again["attempts"]) == (1, 2)
    # done: closed by the slot's next claim, which takes the next row
    (nxt,) = claim(mysql_url, slot="run:0", done=[again])
    assert (nxt["id"], nxt["attempts"]) == (2, 1)
    assert state(mysql_url)[1] == ("done", "run:0", 2)
    # another slot: nothing free; row 2 is claimed and within its lease
    assert claim(mysql_url, slot="run:1") == []
    # past the lease (its slot gone): another slot takes it over; the first slot's late "done"
    # does not close a row that is no longer its own
    age(mysql_url, 2)
    (taken,) = claim(mysql_url, slot="run:1", max_deliveries=3)
    assert (taken["id"], taken["claimed_by"], taken["attempts"]) == (2, "run:1", 2)
    assert claim(mysql_url, slot="run:0", done=[nxt]) == []
    assert state(mysql_url)[2] == ("claimed", "run:1", 2)
    age(mysql_url, 2)
    assert claim(mysql_url, slot="run:2", max_deliveries=3)[0]["attempts"] == 3
    # claimed max_deliveries times and gone stale again: dead-lettered, the claim finds nothing
    age(mysql_url, 2)
    assert claim(mysql_url, slot="run:3", max_deliveries=3) == []
    assert state(mysql_url)[2] == ("dead", "run:2", 3)


def test_a_frame_of_rows_per_claim_taken_back_acked_and_dead_lettered_whole(mysql_url: str) -> None:
    values = ", ".join(f"({n}, {n * 10}, NULL)" for n in range(1, 8))
    svc.mysql_query(mysql_url, f"INSERT INTO work (id, n, note) VALUES {values}")
    svc.mysql_query(mysql_url, "UPDATE work SET status = 'claimed', claimed_by = 'gone', attempts = 3 WHERE id = 2")
    age(mysql_url, 2)  # a poison row among the first ones: dead-lettered, the frame is filled past it

    frame = claim(mysql_url, slot="run:0", rows=3, max_deliveries=3)
    assert [(r["id"], r["attempts"]) for r in frame] == [(1, 1), (3, 1), (4, 1)]
    assert state(mysql_url)[2] == ("dead", "gone", 3)
    # another slot's frame holds none of them
    assert [r["id"] for r in claim(mysql_url, slot="run:1", rows=2)] == [5, 6]
    # the claim died before the engine recorded it: the slot's next claim takes the whole frame back
    again = claim(mysql_url, slot="run:0", rows=3)
    assert [(r["id"], r["attempts"]) for r in again] == [(1, 2), (3, 2), (4, 2)]
    # the frame's rows all over: the next claim closes every one of them and takes what is left
    assert [r["id"] for r in claim(mysql_url, slot="run:0", done=again, rows=3)] == [7]
    assert {i: state(mysql_url)[i][0] for i in (1, 3, 4, 5, 6, 7)} == {
        1: "done",
        3: "done",
        4: "done",
        5: "claimed",
        6: "claimed",
        7: "claimed",
    }


def test_a_short_lease_and_custom_columns(mysql_url: str) -> None:
    svc.mysql_query(
        mysql_url,
        "CREATE TABLE jobs (job_id INT PRIMARY KEY, prio INT, state VARCHAR(16) DEFAULT 'pending', "
        "owner VARCHAR(255), taken DATETIME(6), tries INT DEFAULT 0)",
    )
    svc.mysql_query(mysql_url, "INSERT INTO jobs (job_id, prio) VALUES (1, 1), (2, 9), (3, 5)")
    opts = {
        "table": "jobs",
        "id_column": "job_id",
        "order_by": "prio DESC, job_id",
        "where": "prio > 1",
        "columns": {"status": "state", "claimed_by": "owner", "claimed_at": "taken", "attempts": "tries"},
    }
    (first,) = claim(mysql_url, slot="a", **opts)
    assert (first["job_id"], first["state"], first["owner"], first["tries"]) == (2, "claimed", "a", 1)
    # stale after 1 ms: the claim is taken over by the next claim of another slot (a claim on a
    # quiet machine can come within the millisecond: wait it out first)
    time.sleep(0.01)
    (over,) = claim(mysql_url, slot="b", reclaim_seconds=0.001, **opts)
    assert (over["job_id"], over["owner"], over["tries"]) == (2, "b", 2)
    (other,) = claim(mysql_url, slot="c", done=[], **opts)
    assert other["job_id"] == 3
    assert claim(mysql_url, slot="b", done=[over], **opts) == []  # prio 1 is filtered out
    rows = svc.mysql_query(mysql_url, "SELECT job_id, state FROM jobs ORDER BY job_id")
    assert rows == [
        {"job_id": 1, "state": "pending"},
        {"job_id": 2, "state": "done"},
        {"job_id": 3, "state": "claimed"},
    ]


def test_concurrent_slots_never_share_a_row(mysql_url: str) -> None:
    svc.mysql_query(mysql_url, "INSERT INTO work (id, n) VALUES " + ", ".join(f"({i}, {i})" for i in range(1, 61)))
    got: dict[str, list[int]] = {}

    def slot(name: str) -> None:
        mine: list[int] = []
        done: list[Any] = []
        while rows := claim(mysql_url, slot=name, done=done):
            mine.append(rows[0]["id"])
            done = rows
        got[name] = mine

    threads = [threading.Thread(target=slot, args=(f"s{i}",)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    ids = [i for mine in got.values() for i in mine]
    assert len(got) == 4 and sorted(ids) == list(range(1, 61))  # each row claimed by one slot, once
    assert {s for s, _, _ in state(mysql_url).values()} == {"done"}


def test_wait_seconds_keeps_an_empty_claim_polling(mysql_url: str) -> None:
    timer = threading.Timer(0.6, svc.mysql_query, (mysql_url, "INSERT INTO work (id, n) VALUES (7, 7)"))
    timer.start()
    try:
        (row,) = claim(mysql_url, wait_seconds=10)
    finally:
        timer.cancel()
    assert row["id"] == 7


def test_bad_options_and_an_unreachable_server_are_named(mysql_url: str) -> None:
    def error(credential: Any, **options: Any) -> dict:
        call = ClaimCall(sql="", params={SLOT_PARAM: "s"}, credential=credential, options=options)
        out = cursors.claim("mysql", call)
        assert out.status == "error" and out.error is not None
        return out.error

    assert error({"url": mysql_url})["message"] == "mysql cursor needs `table:` (the work table)"
    assert "plain name" in error({"url": mysql_url}, table="work; DROP TABLE work")["message"]
    assert "order_by takes column names" in error({"url": mysql_url}, table="work", order_by="id; x")["message"]
    assert "needs `auth:`" in error("pg_local", table="work")["message"]
    port = svc.free_port()
    refused = error(f"mysql://app:s3cret-pw@127.0.0.1:{port}/db", table="work")
    assert refused == {
        "kind": "connection",
        "message": f"mysql cursor: cannot reach a MySQL server at 127.0.0.1:{port}",
        "retryable": True,
    }
    missing = error({"url": mysql_url}, table="absent")
    assert missing["kind"] == "cursor" and "(1146)" in missing["message"], missing


def test_a_loop_drains_the_table_and_dead_letters_the_poison(mysql_url: str, tmp_path: Path) -> None:
    code, status = run_playbook(
        f"sqlite:///{tmp_path / 'noetl.sqlite'}",
        ROWS,
        {"mysql_url": mysql_url, "rows": 40, "poison": 2},
        {"NOETL_HOME": str(tmp_path)},
    )
    assert code == 0, status
    assert status["results"]["drain"] == {"stats": {"processed": 40, "failed": 0, "slots": 8}}
    assert status["results"]["verify"] == {"done": 40, "repeats": 0, "open": 0, "dead": [-2, -1]}
