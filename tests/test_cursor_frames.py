"""A cursor claim's frame is kept once, by the row of the decision that first sees it (the claim's
row, or the outcome row of the first row the claim ran), and the messages of its other rows name
that row (`slot.frame`: at, size, pos; message format 3) instead of carrying the rest of the frame
and the rows over: a frame of N rows costs its messages and their stored dispatches N small
references, not N^2 rows. A row message of an earlier release (the rest of the frame inline) still
goes on, inline, and so do all of them while NOETL_MESSAGE_FORMAT is below 3 (a rolling upgrade).
`replay` decides a framed run again the same. In-process, on SQLite and PostgreSQL
(the demo queue's SQLite driver); the kill tests with real workers (tests/distributed) run frames
on every driver."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from noetl_celery import replay
from noetl_celery.compiler import compile_playbook
from noetl_celery.engine.messages import FRAME_VERSION, MESSAGE_VERSION, VERSION_FIELD, Dispatch, written_version
from noetl_celery.store import repo
from noetl_celery.store.db import transaction
from tests.support.harness import Harness, run_playbook

DEMO = Path(__file__).resolve().parents[1] / "playbooks" / "cursor_queue.yaml"
FRAME = "        frame: {max_rows: 2, lease_seconds: 60}\n"


def framed(tmp_path: Path, rows: int, routed: bool = False) -> Path:
    """The demo queue with frames of `rows` rows; `routed`: a routing-only task first in the step's
    body, so that a claim does not run its first row (its frame is kept by the claim's own row)."""
    text = DEMO.read_text()
    assert FRAME in text
    text = text.replace(FRAME, f"        frame: {{max_rows: {rows}, lease_seconds: 60}}\n")
    if routed:
        head, rest = text.split("    tool:\n      kind: python\n      args: {id:", 1)
        block, tail = rest.split("    next:\n", 1)
        task = "      kind: python\n      args: {id:" + block
        body = "".join("    " + line if line.strip() else line for line in task.splitlines(keepends=True))
        text = head + "    tool:\n      - first:\n          kind: noop\n      - square:\n" + body + "    next:\n" + tail
    path = tmp_path / f"cursor_queue_{rows}{'_routed' if routed else ''}.yaml"
    path.write_text(text)
    return path


def stored_row_messages(url: str, execution_id: int) -> tuple[list[dict], list[dict]]:
    """The cursor row messages the execution's decision rows keep (meta.dispatch), and its rows."""
    with transaction(url) as conn:
        events = repo.list_events(conn, execution_id)
    return [
        Dispatch.from_dict(stored).message
        for e in events
        for stored in (e["meta"] or {}).get("dispatch") or []
        if ((stored.get("message") or {}).get("slot") or {}).get("phase") == "row"
    ], events


@pytest.mark.parametrize("routed", [False, True], ids=["claim_runs_row", "claim_row"])
def test_a_frame_is_kept_once_and_its_rows_name_it(either_store, tmp_path, routed):
    url, jobs = either_store, 30
    playbook = framed(tmp_path, 6, routed)
    code, status = run_playbook(url, playbook, {"jobs": jobs, "queue_db": str(tmp_path / "queue.sqlite")})
    assert code == 0 and status["status"] == "completed", status
    assert status["results"]["report"]["done"] == jobs
    messages, events = stored_row_messages(url, status["execution_id"])
    keeping = {e["event_id"]: e["meta"]["frame"] for e in events if "frame" in (e["meta"] or {})}
    assert keeping and all(1 < len(frame) <= 6 for frame in keeping.values())
    referenced = [m for m in messages if "frame" in m["slot"]]
    assert referenced, "no row message named its frame"
    for message in messages:  # no rest of a frame, no rows over, in any stored row message
        assert "rows" not in message["slot"] and "done" not in message["slot"], message["slot"]
    for message in referenced:
        place = message["slot"]["frame"]
        frame = keeping[place["at"]]
        assert len(frame) == place["size"] and frame[place["pos"]] == message["element"]
        assert written_version(message) == FRAME_VERSION
    with transaction(url) as conn:
        items = [e for e in repo.list_events(conn, status["execution_id"]) if e["event_type"] == "cursor.item.done"]
    assert len(items) == jobs and len({e["iteration"] for e in items}) == jobs
    report = replay.replay(url, status["execution_id"])
    assert report.difference is None, report.to_dict()


def test_a_frames_messages_grow_with_its_rows_not_with_their_square(tmp_path):
    """The stored dispatches of a run with frames of 12 take about as many bytes as with frames of
    3, for the same rows (with the rest of the frame in each message, four times as many)."""
    sizes = {}
    for rows in (3, 12):
        url = f"sqlite:///{tmp_path / f'store_{rows}.sqlite'}"
        code, status = run_playbook(
            url, framed(tmp_path, rows), {"jobs": 48, "queue_db": str(tmp_path / f"queue_{rows}.sqlite")}
        )
        assert code == 0 and status["status"] == "completed", status
        messages, _ = stored_row_messages(url, status["execution_id"])
        sizes[rows] = sum(len(json.dumps(m)) for m in messages) / len(messages)
    assert sizes[12] < sizes[3] * 1.2, sizes


def test_a_row_message_of_an_earlier_release_goes_on_inline(either_store, tmp_path):
    """A row message with the rest of its frame and the rows over inline (as an earlier release
    sent it) is decided by this code: its slot's next rows go on inline, format 1, and every row
    is done once."""
    url, jobs = either_store, 12
    plan = compile_playbook(
        framed(tmp_path, 4, routed=True), overrides={"jobs": jobs, "queue_db": str(tmp_path / "q.sqlite")}
    )
    harness = Harness(url)
    execution_id = harness.start(plan)
    converted = []
    while harness.step():
        for n, (due, order, dispatch) in enumerate(harness._queue):
            slot = dispatch.message.get("slot") or {}
            if "frame" in slot and slot["frame"]["pos"] == 1 and not converted:
                with transaction(url) as conn:
                    frame = repo.event_meta(conn, execution_id, slot["frame"]["at"])["frame"]
                old = {k: v for k, v in slot.items() if k != "frame"}
                message = {
                    **dispatch.message,
                    "slot": {**old, "rows": frame[2:], "done": frame[:1]},
                    VERSION_FIELD: MESSAGE_VERSION,
                }
                harness._queue[n] = (due, order, Dispatch.from_dict({**dispatch.to_dict(), "message": message}))
                converted.append(slot["id"])
    assert converted
    with transaction(url) as conn:
        status = repo.get_execution(conn, execution_id)["status"]
        items = [e for e in repo.list_events(conn, execution_id) if e["event_type"] == "cursor.item.done"]
    assert status == "completed" and len({e["iteration"] for e in items}) == len(items) == jobs
    inline = [d.message for d in harness.ran if "rows" in (d.message.get("slot") or {})]
    assert inline and all(written_version(m) == MESSAGE_VERSION for m in inline)


def test_the_frames_a_process_keeps_are_bounded_and_a_frame_not_kept_is_read_again(tmp_path, monkeypatch):
    """With room for no frame in the process's cache, every row's decision reads its frame from
    the store: the run is the same, and the cache holds nothing."""
    from noetl_celery.engine.decision import cursor_loop

    monkeypatch.setattr(cursor_loop, "FRAME_CACHE_BYTES", 10)  # smaller than any frame here
    reads = []
    event_meta = repo.event_meta
    monkeypatch.setattr(repo, "event_meta", lambda *a: reads.append(a[2]) or event_meta(*a))
    url = f"sqlite:///{tmp_path / 'store.sqlite'}"
    code, status = run_playbook(url, framed(tmp_path, 5), {"jobs": 20, "queue_db": str(tmp_path / "q.sqlite")})
    assert code == 0 and status["status"] == "completed" and status["results"]["report"]["done"] == 20
    messages, _ = stored_row_messages(url, status["execution_id"])
    assert len(reads) >= len([m for m in messages if "frame" in m["slot"]]) > 0  # each row read its frame
    assert not any(key[1] == status["execution_id"] for key in cursor_loop._frames)


@pytest.mark.parametrize("routed", [False, True], ids=["claim_runs_row", "claim_row"])
def test_during_a_rolling_upgrade_frames_travel_inline_as_the_older_release_sends_them(
    either_store, tmp_path, monkeypatch, routed
):
    """NOETL_MESSAGE_FORMAT=2 (the newest format a release before frames by reference reads):
    every row message carries the rest of its frame inline, in format 1, and the run and its
    replay are as with references."""
    monkeypatch.setenv("NOETL_MESSAGE_FORMAT", "2")
    url, jobs = either_store, 18
    code, status = run_playbook(
        url, framed(tmp_path, 6, routed), {"jobs": jobs, "queue_db": str(tmp_path / "q.sqlite")}
    )
    assert code == 0 and status["status"] == "completed" and status["results"]["report"]["done"] == jobs
    messages, _ = stored_row_messages(url, status["execution_id"])
    assert messages and all("frame" not in m["slot"] for m in messages)
    assert any(m["slot"].get("rows") for m in messages)  # the rest of a frame, inline
    assert all(written_version(m) == MESSAGE_VERSION for m in messages)
    with transaction(url) as conn:
        items = [e for e in repo.list_events(conn, status["execution_id"]) if e["event_type"] == "cursor.item.done"]
    assert len({e["iteration"] for e in items}) == len(items) == jobs
    assert replay.replay(url, status["execution_id"]).difference is None


def big_rows(tmp_path: Path) -> Path:
    """The routed demo queue with frames of 6 rows of about 400 bytes each."""
    text = framed(tmp_path, 6, routed=True).read_text()
    assert "RETURNING id, n" in text
    playbook = tmp_path / "big_rows.yaml"
    playbook.write_text(text.replace("RETURNING id, n", "RETURNING id, n, printf('%.400c', 'x') AS payload"))
    return playbook


def test_a_frame_above_the_row_cap_is_read_whole_not_taken_for_an_empty_claim(either_store, tmp_path, monkeypatch):
    """A claim's rows above NOETL_MAX_RESULT_BYTES reach on_event by reference (store/blobs.py):
    the claim's decision reads them whole. Taken for no rows, the slot would end with its frame
    claimed and never run (every claim was, before: 0 of 24 rows done, and the loop completed)."""
    monkeypatch.setenv("NOETL_MAX_RESULT_BYTES", "2000")  # a frame of 6 rows of ~400 bytes is above it
    playbook = big_rows(tmp_path)
    url, jobs = either_store, 24
    code, status = run_playbook(url, playbook, {"jobs": jobs, "queue_db": str(tmp_path / "q.sqlite")})
    assert code == 0 and status["status"] == "completed", status.get("error")
    assert status["results"]["report"]["done"] == jobs
    _, events = stored_row_messages(url, status["execution_id"])
    frames = [e["meta"]["frame"] for e in events if "frame" in (e["meta"] or {})]
    assert frames and all(len(f) > 1 and len(f[0]["payload"]) == 400 for f in frames)


def test_a_frame_the_store_had_to_cut_fails_the_claim_by_name(tmp_path, monkeypatch):
    """Rows above NOETL_MAX_STORED_BYTES are cut to a marker: the claim fails (kind `limit`, what to
    change), tried again as a failed claim is, then the step fails; no slot ends as if it found
    no rows."""
    monkeypatch.setenv("NOETL_MAX_RESULT_BYTES", "1000")
    monkeypatch.setenv("NOETL_MAX_STORED_BYTES", "1500")  # a frame of 6 rows of ~400 bytes is above both
    url = f"sqlite:///{tmp_path / 'store.sqlite'}"
    code, status = run_playbook(url, big_rows(tmp_path), {"jobs": 12, "queue_db": str(tmp_path / "q.sqlite")})
    assert status["status"] == "failed" and status["failed_step"] == "drain", status
    assert "lower the frame's max_rows" in status["error"]["message"]
    with transaction(url) as conn:
        claims = [e for e in repo.list_events(conn, status["execution_id"]) if e["task"] == "claim"]
    failed = [e for e in claims if e["event_type"] == "cursor.claim.failed"]
    assert failed and all(e["error"]["kind"] == "limit" for e in failed)
    # the slots that ended found no row: the queue's 12 rows went to the two frames that failed
    assert all(e["meta"]["rows"] == 0 for e in claims if e["event_type"] == "cursor.slot.ended")
    assert {e["meta"]["slot"] for e in failed}.isdisjoint(
        e["meta"]["slot"] for e in claims if e["event_type"] == "cursor.slot.ended"
    )
