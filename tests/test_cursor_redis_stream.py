"""The redis_stream cursor driver on the local Redis (this session's database, streams of each
test's own): the claim contract, and a cursor loop run in-process."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from noetl_celery import cursors
from noetl_celery.cursors import SLOT_PARAM, ClaimCall
from tests.support.engines import REPO_ROOT
from tests.support.harness import run_playbook
from tests.support.services import redis_client

EXAMPLE = REPO_ROOT / "playbooks" / "cursor_redis_stream.yaml"


@pytest.fixture
def stream(redis_url: str) -> Iterator[str]:
    key = f"test:cursor:{uuid.uuid4().hex[:10]}"
    yield key
    redis_client(redis_url).delete(key, f"{key}:dead", f"{key}:seen")


def claim(redis_url: str, stream: str, slot: str = "run:0", done: list[Any] | None = None, **options: Any) -> Any:
    call = ClaimCall(
        sql="",
        params={SLOT_PARAM: slot},
        credential={"url": redis_url},
        timeout=options.pop("lease", 60),
        options={"stream": stream, **options},
        done=done or [],
        max_rows=options.pop("rows", 1),
    )
    outcome = cursors.claim("redis_stream", call)
    assert outcome.status == "ok", outcome.error
    return outcome.data["rows"]


def idle(r: Any, stream: str, owner: str, entry_id: str) -> None:
    """Make a pending entry idle for 10 minutes (XCLAIM ... IDLE ... JUSTID counts no delivery)."""
    r.xclaim(stream, "noetl", owner, 0, [entry_id], idle=600_000, justid=True)


def test_row_or_nothing_ack_take_back_and_dead_letter(redis_url: str, stream: str) -> None:
    r = redis_client(redis_url)
    assert claim(redis_url, stream) == []  # an empty stream (created with the group) ends the slot
    first = r.xadd(stream, {"n": "1"})
    second = r.xadd(stream, {"n": "2"})

    (row,) = claim(redis_url, stream, slot="run:0")
    assert row == {"id": first.decode(), "n": "1", "deliveries": 1}
    # the slot's claim died before it was recorded: the slot's next claim takes the entry back
    (again,) = claim(redis_url, stream, slot="run:0")
    assert (again["id"], again["deliveries"]) == (row["id"], 2)
    # done: acknowledged by the next claim, which reads the next entry
    (nxt,) = claim(redis_url, stream, slot="run:0", done=[again])
    assert nxt["n"] == "2" and nxt["deliveries"] == 1
    assert r.xpending(stream, "noetl")["pending"] == 1
    # another slot: nothing new; the other slot's entry is not idle past the lease
    assert claim(redis_url, stream, slot="run:1") == []
    # idle past the lease (its chain's worker gone): another slot takes it back; past
    # max_deliveries it is dead-lettered
    idle(r, stream, "run:0", nxt["id"])
    (taken,) = claim(redis_url, stream, slot="run:1", max_deliveries=3)
    assert (taken["id"], taken["deliveries"]) == (nxt["id"], 2)
    idle(r, stream, "run:1", nxt["id"])
    assert claim(redis_url, stream, slot="run:2", max_deliveries=3)[0]["deliveries"] == 3
    idle(r, stream, "run:2", nxt["id"])
    assert claim(redis_url, stream, slot="run:3", max_deliveries=3) == []
    dead = r.xrange(f"{stream}:dead")
    assert len(dead) == 1
    fields = {k.decode(): v.decode() for k, v in dead[0][1].items()}
    assert fields == {"n": "2", "source_id": nxt["id"], "source_stream": stream, "deliveries": "4"}
    assert r.xpending(stream, "noetl")["pending"] == 0
    assert second.decode() == nxt["id"]


def test_a_frame_of_entries_per_claim_taken_back_acked_and_dead_lettered_whole(redis_url: str, stream: str) -> None:
    r = redis_client(redis_url)
    claim(redis_url, stream)  # creates the group
    ids = [r.xadd(stream, {"n": str(n)}).decode() for n in range(1, 8)]
    # a stale entry of a vanished consumer, on its last delivery, and one past it: the frame takes
    # the first and dead-letters the second
    r.xreadgroup("noetl", "gone", {stream: ">"}, count=2)
    for _ in range(2):
        r.xclaim(stream, "noetl", "gone", 0, [ids[1]])
    for entry in ids[:2]:
        idle(r, stream, "gone", entry)

    frame = claim(redis_url, stream, slot="run:0", rows=3, max_deliveries=3)
    assert [(row["n"], row["deliveries"]) for row in frame] == [("1", 2), ("3", 1), ("4", 1)]
    assert [fields[b"n"] for _, fields in r.xrange(f"{stream}:dead")] == [b"2"]
    # another slot's frame holds none of them
    assert [row["n"] for row in claim(redis_url, stream, slot="run:1", rows=2)] == ["5", "6"]
    # the claim died before the engine recorded it: the slot's next claim takes the whole frame back
    again = claim(redis_url, stream, slot="run:0", rows=3)
    assert [(row["n"], row["deliveries"]) for row in again] == [("1", 3), ("3", 2), ("4", 2)]
    # the frame's entries all over: the next claim acks every one of them and reads what is left
    assert [row["n"] for row in claim(redis_url, stream, slot="run:0", done=again, rows=3)] == ["7"]
    pending = {p["message_id"].decode() for p in r.xpending_range(stream, "noetl", "-", "+", 10)}
    assert pending == {ids[4], ids[5], ids[6]}


def test_a_claim_without_a_stream_or_url_is_refused(redis_url: str) -> None:
    out = cursors.claim("redis_stream", ClaimCall(sql="", credential={"url": redis_url}))
    assert out.error is not None and out.error["message"] == "redis_stream cursor needs `stream:` (the stream's key)"
    out = cursors.claim("redis_stream", ClaimCall(sql="", credential="pg_local", options={"stream": "s"}))
    assert out.error is not None and "needs `auth:` naming a redis:// URL" in out.error["message"]


def test_the_example_loop_processes_every_entry_once_and_dead_letters_the_poison(
    redis_url: str, stream: str, tmp_path: Path
) -> None:
    code, status = run_playbook(
        f"sqlite:///{tmp_path / 'noetl.sqlite'}",
        EXAMPLE,
        {"redis_url": redis_url, "stream": stream, "jobs": 60, "poison": True},
        {"NOETL_HOME": str(tmp_path)},
    )
    assert code == 0, status
    report = status["results"]["report"]
    assert report == {
        "done": 60,
        "each_once": True,
        "sum_of_squares": sum(n * n for n in range(1, 61)),
        "dead_letter": [{"n": "-1", "deliveries": "4"}],
        "pending": 0,
        "stats": {"processed": 60, "failed": 0, "slots": 4},
    }


def test_another_slots_entry_is_taken_over_only_past_reclaim_seconds(redis_url: str, stream: str) -> None:
    """Default reclaim_seconds = 2 x lease + 30 (150 s for a 60 s lease): an entry idle past one
    lease may belong to a live slot whose next claim the sweeper has yet to re-publish."""
    r = redis_client(redis_url)
    claim(redis_url, stream)  # creates the group
    entry = r.xadd(stream, {"n": "1"}).decode()
    assert claim(redis_url, stream, slot="run:0")[0]["id"] == entry
    r.xclaim(stream, "noetl", "run:0", 0, [entry], idle=100_000, justid=True)  # past the lease only
    assert claim(redis_url, stream, slot="run:1") == []
    r.xclaim(stream, "noetl", "run:0", 0, [entry], idle=160_000, justid=True)  # past 2 x 60 + 30
    assert claim(redis_url, stream, slot="run:1")[0]["id"] == entry
    r.xclaim(stream, "noetl", "run:1", 0, [entry], idle=20_000, justid=True)
    assert claim(redis_url, stream, slot="run:2", reclaim_seconds=10)[0]["id"] == entry


def test_wait_seconds_keeps_an_empty_claim_waiting(redis_url: str, stream: str) -> None:
    import threading

    assert claim(redis_url, stream) == []
    timer = threading.Timer(0.5, lambda: redis_client(redis_url).xadd(stream, {"n": "9"}))
    timer.start()
    try:
        (row,) = claim(redis_url, stream, wait_seconds=10)
    finally:
        timer.cancel()
    assert row["n"] == "9"
