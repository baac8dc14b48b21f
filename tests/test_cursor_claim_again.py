"""A claim that finds no row but whose driver knows rows a lost claim took come back later
(`again_in`, cursors/__init__.py) does not end its slot: the claim is recorded
(`cursor.claim.waiting`, with `again_in`) and the slot claims again after that countdown. Without
it, the other slots end, the loop completes, and the rows that come back are never run. In-process
(the harness's clock runs the countdown), with a queue driver of this test's own; the nats
driver's side is tests/test_cursor_nats.py, on the real server."""

from __future__ import annotations

import subprocess
import sys
import threading

import pytest

from noetl_celery import cursors, replay
from noetl_celery.cursors import ClaimCall
from noetl_celery.store import repo
from noetl_celery.store.db import transaction
from noetl_celery.tools.base import Outcome
from tests.support.harness import run_playbook

ROWS, LOST = 10, (11, 12)  # rows available at once; rows a lost claim took, back after AGAIN_IN
AGAIN_IN = 3.0


class LostClaimQueue:
    """Rows 1..ROWS at once; the LOST rows come back only after the first empty claim, which says
    so with `again_in` (as the nats driver does for a pull its worker never recorded)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.pending = list(range(1, ROWS + 1))
        self.back = False

    def claim(self, call: ClaimCall) -> Outcome:
        with self.lock:
            take, self.pending = self.pending[: call.max_rows], self.pending[call.max_rows :]
            if take or self.back:
                return Outcome.ok({"rows": [{"n": n} for n in take]})
            self.back, self.pending = True, list(LOST)
            return Outcome.ok({"rows": [], "again_in": AGAIN_IN})


PLAYBOOK = """
apiVersion: noetl.io/v2
kind: Playbook
metadata: {name: claim_again}
workflow:
  - step: start
    next:
      arcs: [{step: drain}]
  - step: drain
    loop:
      cursor: {kind: lost_claim_queue}
      iterator: row
      spec:
        mode: cursor
        max_in_flight: 3
        frame: {max_rows: 2, lease_seconds: 60}
    tool:
      kind: python
      args: {n: "{{ iter.row.n }}"}
      code: |
        result = n * 10
    next:
      arcs:
        - step: end
          when: "{{ event.name == 'loop.done' }}"
  - step: end
"""


@pytest.fixture
def lost_claim_queue() -> LostClaimQueue:
    queue = LostClaimQueue()
    cursors.register("lost_claim_queue", needs_claim=False)(queue.claim)
    try:
        yield queue
    finally:
        cursors._DRIVERS.pop("lost_claim_queue", None)
        cursors._OPTIONS.pop("lost_claim_queue", None)


def test_a_claim_that_knows_rows_come_back_keeps_its_slot_and_claims_again(either_store, tmp_path, lost_claim_queue):
    url = either_store
    playbook = tmp_path / "claim_again.yaml"
    playbook.write_text(PLAYBOOK)
    code, status = run_playbook(url, playbook)
    assert code == 0 and status["status"] == "completed", status
    assert status["results"]["drain"]["stats"] == {"processed": ROWS + len(LOST), "failed": 0, "slots": 3}
    with transaction(url) as conn:
        events = repo.list_events(conn, status["execution_id"])
    claims = [e for e in events if e["task"] == "claim"]
    (waiting,) = [e for e in claims if e["event_type"] == "cursor.claim.waiting"]
    assert waiting["status"] == "completed" and waiting["meta"]["again_in"] == AGAIN_IN
    assert waiting["meta"]["rows"] == 0
    # its slot claimed again, under the slot's next claim number, and that slot ended only then
    slot, number = waiting["meta"]["slot"], waiting["meta"]["claim"]
    mine = [e for e in events if (e["meta"] or {}).get("slot") == slot and "claim" in e["meta"]]
    assert any(e["meta"]["claim"] == number + 1 for e in mine), mine
    assert max(mine, key=lambda e: e["id"])["event_type"] == "cursor.slot.ended"
    ended = [e for e in claims if e["event_type"] == "cursor.slot.ended"]
    assert len(ended) == 3 and len({e["meta"]["slot"] for e in ended}) == 3
    done = [e["meta"]["row"]["n"] for e in events if e["event_type"] == "cursor.item.done"]
    assert sorted(done) == list(range(1, ROWS + len(LOST) + 1))
    assert replay.replay(url, status["execution_id"]).difference is None


@pytest.mark.parametrize("again", [0, -1, "3", True, None])
def test_an_again_in_that_is_not_a_positive_number_ends_the_slot(again):
    from noetl_celery.engine.decision.cursor_loop import _again_in

    assert _again_in({"status": "ok", "data": {"rows": [], "again_in": again}}) == 0.0
    assert _again_in({"status": "ok", "data": {"rows": [], "again_in": 1e9}}) == 3600.0
    assert _again_in({"status": "error", "data": {"again_in": 5}}) == 0.0


def test_a_driver_registered_or_imported_first_does_not_hide_the_built_in_ones():
    """The built-in drivers load on the first lookup, whatever was registered before it (this
    test's own driver, or one built-in module imported on its own, as a worker app may)."""
    code = (
        "from noetl_celery import cursors\n"
        "from noetl_celery.cursors import nats\n"
        "cursors.register('mine', needs_claim=False)(lambda call: None)\n"
        "print(' '.join(cursors.known_kinds()))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60)
    assert out.stdout.split() == ["mine", "mysql", "nats", "postgres", "redis_stream", "sqlite"], out
