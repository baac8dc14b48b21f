"""The nats cursor driver on the machine's NATS JetStream (a stream, consumer and buckets of each
test's own): the claim contract (row or nothing, ack when done, take back, dead letter) and a
loop run in-process."""

from __future__ import annotations

import asyncio
import contextlib
import json
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from noetl_celery import cursors
from noetl_celery.cursors import SLOT_PARAM, ClaimCall
from noetl_celery.cursors import nats as nats_cursor
from tests.support import services as svc
from tests.support.harness import run_playbook

ROOT = Path(__file__).resolve().parents[1]
ROWS = ROOT / "tests" / "playbooks" / "cursor_rows_nats.yaml"


async def _js(url: str, fn: Any) -> Any:
    import nats

    nc = await nats.connect(url)
    try:
        return await fn(nc.jetstream())
    finally:
        await nc.close()


def js_call(url: str, fn: Any) -> Any:
    return asyncio.run(_js(url, fn))


@pytest.fixture
def nats_url() -> str:
    return svc.nats_server_url()


@pytest.fixture
def names(nats_url: str) -> Iterator[dict[str, str]]:
    """A stream (subjects <stream>.>), a dead-letter subject, a slots bucket and a KV bucket of
    this test's own, all deleted after it."""
    tag = uuid.uuid4().hex[:10]
    made = {"stream": f"T{tag}", "dead": f"T{tag}_dead.jobs", "slots": f"slots_{tag}", "bucket": f"kv_{tag}"}

    async def create(js: Any) -> None:
        await js.add_stream(name=made["stream"], subjects=[f"{made['stream']}.>"])
        await js.create_key_value(bucket=made["bucket"])

    async def delete(js: Any) -> None:
        for stream in (made["stream"], f"{made['stream']}_DEAD", f"KV_{made['slots']}", f"KV_{made['bucket']}"):
            with contextlib.suppress(Exception):  # one this test did not create
                await js.delete_stream(stream)

    js_call(nats_url, create)
    yield made
    js_call(nats_url, delete)


def publish(url: str, stream: str, *values: Any) -> None:
    async def go(js: Any) -> None:
        for value in values:
            await js.publish(f"{stream}.jobs", json.dumps(value).encode())

    js_call(url, go)


def claim(url: str, names: dict[str, str], slot: str = "run:0", done: list[Any] | None = None, **options: Any) -> Any:
    """The rows of one claim (which must succeed and not ask to claim again later)."""
    data = claim_data(url, names, slot, done, **options)
    assert "again_in" not in data, data
    return data["rows"]


def claim_data(url: str, names: dict[str, str], slot: str, done: list[Any] | None = None, **options: Any) -> Any:
    outcome = cursors.claim("nats", claim_call(url, names, slot, done, **options))
    assert outcome.status == "ok", outcome.error
    return outcome.data


def claim_call(url: str, names: dict[str, str], slot: str, done: list[Any] | None = None, **options: Any) -> ClaimCall:
    """A claim of `slot` on the test's stream; `lease` (seconds) and `rows` (the frame's max_rows)
    are the frame's, other keywords cursor keys."""
    lease, rows = options.pop("lease", 60), options.pop("rows", 1)
    return ClaimCall(
        sql="",
        params={SLOT_PARAM: slot},
        credential={"url": url},
        timeout=lease,
        options={"stream": names["stream"], "slots_bucket": names["slots"], "dead_letter": names["dead"], **options},
        done=done or [],
        max_rows=rows,
    )


def consumer_state(url: str, stream: str) -> tuple[int, int]:
    async def go(js: Any) -> tuple[int, int]:
        info = await js.consumer_info(stream, "noetl")
        return info.num_ack_pending, info.num_pending

    return js_call(url, go)


def test_row_or_nothing_ack_when_done_and_take_back(nats_url: str, names: dict[str, str]) -> None:
    assert claim(nats_url, names) == []  # an empty stream ends the slot (the consumer is created)
    publish(nats_url, names["stream"], {"n": 1}, "two")

    (row,) = claim(nats_url, names, slot="run:0")
    assert {k: row[k] for k in ("seq", "subject", "deliveries", "data")} == {
        "seq": 1,
        "subject": f"{names['stream']}.jobs",
        "deliveries": 1,
        "data": {"n": 1},
    }
    assert row["ack"].startswith(f"$JS.ACK.{names['stream']}.noetl.")
    # the slot's claim died before it was recorded: the slot's next claim gets the same message
    (again,) = claim(nats_url, names, slot="run:0")
    assert again == row
    # another slot gets the next message, not the one held
    (other,) = claim(nats_url, names, slot="run:1")
    assert (other["seq"], other["data"]) == (2, "two")
    assert consumer_state(nats_url, names["stream"]) == (2, 0)
    # done: acked by the slot's next claim, which finds nothing more
    assert claim(nats_url, names, slot="run:0", done=[again]) == []
    assert claim(nats_url, names, slot="run:1", done=[other]) == []
    assert consumer_state(nats_url, names["stream"]) == (0, 0)


def test_a_frame_of_messages_per_claim_taken_back_and_acked_whole(nats_url: str, names: dict[str, str]) -> None:
    assert claim(nats_url, names) == []  # creates the consumer
    publish(nats_url, names["stream"], *({"n": n} for n in range(1, 7)))

    frame = claim(nats_url, names, slot="run:0", rows=4)
    assert [row["data"]["n"] for row in frame] == [1, 2, 3, 4]
    # the claim died before the engine recorded it: the slot's next claim gets the whole frame again
    assert claim(nats_url, names, slot="run:0", rows=4) == frame
    # another slot's frame: what is left (fewer than asked for)
    other = claim(nats_url, names, slot="run:1", rows=4)
    assert [row["data"]["n"] for row in other] == [5, 6]
    assert consumer_state(nats_url, names["stream"]) == (6, 0)
    # the frame's messages all over: the next claim acks every one of them and finds nothing more
    assert claim(nats_url, names, slot="run:0", done=frame, rows=4) == []
    assert consumer_state(nats_url, names["stream"]) == (2, 0)
    # a claim that acks a frame and takes the next one, its worker dead before the engine recorded
    # it: sent again with the same done, it returns the frame it took the first time
    publish(nats_url, names["stream"], {"n": 7}, {"n": 8})
    taken = claim(nats_url, names, slot="run:1", done=other, rows=4)
    assert [row["data"]["n"] for row in taken] == [7, 8]
    assert claim(nats_url, names, slot="run:1", done=other, rows=4) == taken
    assert consumer_state(nats_url, names["stream"]) == (2, 0)
    assert claim(nats_url, names, slot="run:1", done=taken, rows=4) == []
    assert consumer_state(nats_url, names["stream"]) == (0, 0)


def test_an_unacked_message_comes_back_after_ack_wait_and_the_poison_is_dead_lettered(
    nats_url: str, names: dict[str, str]
) -> None:
    publish(nats_url, names["stream"], {"n": 7})
    short = {"reclaim_seconds": 1, "max_deliveries": 2}
    (first,) = claim(nats_url, names, slot="a", **short)
    assert first["deliveries"] == 1
    # slot a is gone: after AckWait (1 s) the server hands the message to the next fetch
    (second,) = claim(nats_url, names, slot="b", wait_seconds=5, **short)
    assert (second["seq"], second["deliveries"]) == (first["seq"], 2)
    # gone again: its third delivery is past max_deliveries, so it goes to the dead letter
    assert claim(nats_url, names, slot="c", wait_seconds=3, **short) == []

    async def dead(js: Any) -> Any:
        info = await js.stream_info(f"{names['stream']}_DEAD")
        return info.state.messages, await js.get_msg(f"{names['stream']}_DEAD", 1)

    count, msg = js_call(nats_url, dead)
    assert count == 1 and json.loads(msg.data) == {"n": 7} and msg.subject == names["dead"]
    assert {k: v for k, v in msg.headers.items() if k.startswith("Noetl-")} == {
        "Noetl-Source-Stream": names["stream"],
        "Noetl-Source-Sequence": "1",
        "Noetl-Source-Subject": f"{names['stream']}.jobs",
        "Noetl-Deliveries": "3",
    }
    assert consumer_state(nats_url, names["stream"]) == (0, 0)


def test_a_pull_never_recorded_keeps_its_slot_claiming_until_its_messages_come_back(
    nats_url: str, names: dict[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A worker killed between a claim's pull and the slot's record of it leaves messages
    delivered, unacknowledged and named by no record until AckWait. The slot's claim run again
    finds none available; rather than end (the loop could then complete without them), it asks
    to claim again later (`again_in`) while they may be pending, and gets them once they are back."""
    short = {"reclaim_seconds": 2, "rows": 2}
    assert claim(nats_url, names, **short) == []  # creates the consumer (AckWait 2 s)
    publish(nats_url, names["stream"], {"n": 1}, {"n": 2})
    keep = nats_cursor._Slot._keep

    async def killed(self: Any, kv: Any, record: dict[str, Any], last: int) -> int:
        if "held" in record:  # the pull is done, its record is not written: the worker dies here
            raise RuntimeError("worker killed")
        return await keep(self, kv, record, last)

    monkeypatch.setattr(nats_cursor._Slot, "_keep", killed)
    lost = cursors.claim("nats", claim_call(nats_url, names, "run:0", **short))
    assert lost.status == "error" and "worker killed" in lost.error["message"], lost
    monkeypatch.setattr(nats_cursor._Slot, "_keep", keep)
    assert consumer_state(nats_url, names["stream"]) == (2, 0)  # delivered, acknowledged by none

    again = claim_data(nats_url, names, "run:0", **short)  # the same claim, run again
    assert again["rows"] == [] and nats_cursor.ORPHAN_POLL_MIN <= again["again_in"] <= nats_cursor.ORPHAN_POLL
    assert claim(nats_url, names, slot="run:1", **short) == []  # another slot, with no lost pull, ends
    deadline = time.monotonic() + 30
    rows: list[Any] = []
    while not rows:  # as the engine would: the slot's next claim after again_in, until they are back
        assert time.monotonic() < deadline, "the lost pull's messages never came back"
        time.sleep(again["again_in"])
        again = claim_data(nats_url, names, "run:0", **short)
        rows = again["rows"]
    assert [(row["data"]["n"], row["deliveries"]) for row in rows] == [(1, 2), (2, 2)]
    # done: acked by the slot's next claim, which ends the slot (nothing is pending any more)
    assert claim(nats_url, names, slot="run:0", done=rows, **short) == []
    assert consumer_state(nats_url, names["stream"]) == (0, 0)


def _run_beside(
    first_pauses: str, monkeypatch: pytest.MonkeyPatch, first: ClaimCall, second: ClaimCall
) -> tuple[Any, Any]:
    """Two copies of one claim at once (the claim delivered again while its first delivery still
    runs): the first copy stops right after its driver's `first_pauses` step (`_record`: it has
    read the slot's record; `_pull`: it has taken its messages, not yet recorded them), the second
    runs whole meanwhile, then the first goes on. Both outcomes' data, first copy first."""
    step = getattr(nats_cursor._Slot, first_pauses)
    paused, go_on = threading.Event(), threading.Event()

    async def pausing(self: Any, *args: Any) -> Any:
        result = await step(self, *args)
        if not paused.is_set():  # the first copy's call: it waits for the second copy to end
            paused.set()
            while not go_on.is_set():
                await asyncio.sleep(0.01)
        return result

    monkeypatch.setattr(nats_cursor._Slot, first_pauses, pausing)
    outcomes: dict[str, Any] = {}
    copy = threading.Thread(target=lambda: outcomes.update(first=cursors.claim("nats", first)))
    copy.start()
    assert paused.wait(20), "the first copy never reached its pause"
    outcomes["second"] = cursors.claim("nats", second)
    go_on.set()
    copy.join(20)
    assert not copy.is_alive()
    monkeypatch.setattr(nats_cursor._Slot, first_pauses, step)
    for outcome in outcomes.values():
        assert outcome.status == "ok", outcome.error
    return outcomes["first"].data, outcomes["second"].data


def _drain_slot(url: str, names: dict[str, str], data: Any, **options: Any) -> list[int]:
    """The slot's claims after the engine recorded `data` as its claim's outcome, as the engine
    makes them (`done` the recorded rows; none after `again_in`), until the slot ends: the
    payloads of the rows they returned."""
    seen: list[int] = []
    for _ in range(10):
        if not data["rows"] and not data.get("again_in"):
            return seen
        done = [] if data.get("again_in") else data["rows"]
        data = claim_data(url, names, "run:0", done=done, **options)
        seen += [row["data"]["n"] for row in data["rows"]]
    raise AssertionError(f"the slot never ended: {seen}")


@pytest.mark.parametrize("recorded", ["first", "second"])
def test_two_copies_of_one_claim_that_both_pull_lose_no_message(
    nats_url: str, names: dict[str, str], monkeypatch: pytest.MonkeyPatch, recorded: str
) -> None:
    """The first copy pulls, then the second copy runs whole and pulls other messages, then the
    first records its pull: each copy's messages are named by the slot's record, so whichever
    copy's rows the engine records, the slot's next claims return the other's (before, the last
    write won and the other copy's messages waited, named by nothing, for AckWait)."""
    frame = {"rows": 2}
    assert claim(nats_url, names, **frame) == []  # creates the consumer
    publish(nats_url, names["stream"], *({"n": n} for n in range(1, 6)))
    call = claim_call(nats_url, names, "run:0", **frame)
    first, second = _run_beside("_pull", monkeypatch, call, call)
    assert [row["data"]["n"] for row in first["rows"]] == [1, 2]
    assert [row["data"]["n"] for row in second["rows"]] == [3, 4]
    outcome = first if recorded == "first" else second
    rest = _drain_slot(nats_url, names, outcome, **frame)
    processed = sorted([row["data"]["n"] for row in outcome["rows"]] + rest)
    assert processed == [1, 2, 3, 4, 5], rest  # each once: none lost, none returned twice
    assert consumer_state(nats_url, names["stream"]) == (0, 0)


@pytest.mark.parametrize("recorded", ["first", "second"])
def test_a_copy_of_a_claim_that_finds_the_record_changed_takes_nothing_and_claims_again(
    nats_url: str, names: dict[str, str], monkeypatch: pytest.MonkeyPatch, recorded: str
) -> None:
    """The first copy reads the slot's record, then the second copy runs whole: the first copy's
    mark before its pull finds the record changed, so it takes nothing and asks to claim again
    soon. Whichever outcome the engine records, every message is processed once."""
    frame = {"rows": 2}
    assert claim(nats_url, names, **frame) == []
    publish(nats_url, names["stream"], *({"n": n} for n in range(1, 4)))
    call = claim_call(nats_url, names, "run:0", **frame)
    first, second = _run_beside("_record", monkeypatch, call, call)
    assert first == {"rows": [], "again_in": nats_cursor.ORPHAN_POLL_MIN}
    assert [row["data"]["n"] for row in second["rows"]] == [1, 2]
    assert consumer_state(nats_url, names["stream"]) == (2, 1)  # the first copy pulled nothing
    outcome = first if recorded == "first" else second
    rest = _drain_slot(nats_url, names, outcome, **frame)
    assert sorted([row["data"]["n"] for row in outcome["rows"]] + rest) == [1, 2, 3], rest
    assert consumer_state(nats_url, names["stream"]) == (0, 0)


def test_wait_seconds_keeps_an_empty_claim_waiting(nats_url: str, names: dict[str, str]) -> None:
    assert claim(nats_url, names) == []
    timer = threading.Timer(0.5, publish, (nats_url, names["stream"], {"n": 3}))
    timer.start()
    try:
        (row,) = claim(nats_url, names, wait_seconds=10)
    finally:
        timer.cancel()
    assert row["data"] == {"n": 3}


def test_bad_options_a_missing_stream_and_an_unreachable_server_are_named(nats_url: str) -> None:
    def error(credential: Any, **options: Any) -> dict:
        out = cursors.claim("nats", ClaimCall(sql="", params={SLOT_PARAM: "s"}, credential=credential, options=options))
        assert out.status == "error" and out.error is not None
        return out.error

    assert error({"url": nats_url})["message"] == "nats cursor needs `stream:` (the JetStream stream)"
    missing = error({"url": nats_url}, stream=f"absent_{uuid.uuid4().hex[:8]}")
    assert missing["kind"] == "not_found" and "no JetStream stream" in missing["message"], missing
    port = svc.free_port()
    refused = error(f"nats://app:s3cret-pw@127.0.0.1:{port}", stream="s")
    assert refused == {
        "kind": "connection",
        "message": f"nats cursor: cannot reach a NATS server at nats://127.0.0.1:{port}",
        "retryable": True,
    }


def test_a_loop_drains_the_stream_and_dead_letters_the_poison(
    nats_url: str, names: dict[str, str], tmp_path: Path
) -> None:
    js_call(nats_url, lambda js: js.delete_stream(names["stream"]))  # the playbook creates its stream
    code, status = run_playbook(
        f"sqlite:///{tmp_path / 'noetl.sqlite'}",
        ROWS,
        {"nats_url": nats_url, "stream": names["stream"], "bucket": names["bucket"], "rows": 40, "poison": 2},
        {"NOETL_HOME": str(tmp_path)},
    )
    assert code == 0, status
    assert status["results"]["start"] == {"seeded": 42, "poison_deliveries": [5, 5]}
    assert status["results"]["drain"] == {"stats": {"processed": 40, "failed": 0, "slots": 8}}
    assert status["results"]["verify"] == {"done": 40, "unacked": 0, "pending": 0, "dead": [-2, -1]}
