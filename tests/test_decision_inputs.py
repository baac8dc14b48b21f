"""A decision's inputs (clock, draws, bounds) and its reads (the `Reads` protocol) given in memory."""

from __future__ import annotations

import pytest

from noetl_celery.core.errors import TemplateError
from noetl_celery.dsl.plan import Action, Loop, Step, Task
from noetl_celery.engine.decision import pagination, policy_eval
from noetl_celery.engine.decision.inputs import Bound, Bounds, DecisionInputs, RandomDraws, RecordedDraws
from noetl_celery.engine.decision.loops import build_items
from noetl_celery.engine.decision.reads import Reads
from noetl_celery.engine.messages import TaskMessage
from tests.support.reads import ReadsInMemory


def test_recorded_draws_give_back_what_lies_in_range_then_draw_anew():
    draws = RecordedDraws([0.7, 3.0])
    assert draws.uniform(2.0, 4.0) == 3.0  # the first recorded value in range, taken once
    assert draws.uniform(0.5, 1.0) == 0.7
    fresh = draws.uniform(10.0, 11.0)
    assert 10.0 <= fresh <= 11.0 and draws.offered == []


def test_a_jittered_backoff_draws_from_the_decision_s_draws():
    action = Action(do="retry", backoff="fixed", delay=4, jitter=True)
    with policy_eval.drawing(RecordedDraws([2.5])):
        assert policy_eval.next_backoff(action, 1) == 2.5
    with policy_eval.drawing(RandomDraws()):
        assert 2.0 <= policy_eval.next_backoff(action, 1) <= 4.0


def test_the_loop_item_bound_comes_from_the_inputs():
    bounds = Bounds(max_steps=Bound(10, "STEPS"), max_loop_items=Bound(2, "ITEMS"))
    step = Step(name="s", loop=Loop(collection="{{ xs }}"))
    assert build_items(step, {"xs": [1, 2]}, bounds) == [1, 2]
    with pytest.raises(TemplateError, match=r"has 3 elements, more than ITEMS \(2\)"):
        build_items(step, {"xs": [1, 2, 3]}, bounds)
    loaded = DecisionInputs.load()
    assert loaded.bounds.max_loop_items.env == "NOETL_MAX_LOOP_ITEMS" and loaded.clock().tzinfo is not None


def test_pages_are_collected_from_reads_held_in_memory():
    reads: Reads = ReadsInMemory(
        [
            {
                "event_type": "page.completed",
                "event_id": f"r.s{seq}.a1.done",
                "run_id": "r",
                "iteration": None,
                "task": "get",
                "result": [seq],
            }
            for seq in (0, 1)
        ]
    )
    task = Task(label="get", kind="http")
    message = TaskMessage(execution_id=1, run_id="r", step="s", seq=2, page=3)
    assert pagination.collect_pages(reads, message, task, [2]) == [0, 1, 2]
