"""Rows per unit of work (the store's cost of a loop): a loop iteration writes its start and its
end, and each further task of its pipeline one row more (its outcome; the previous task's outcome
row is its start). Run in-process on the harness, on SQLite."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

from noetl_celery import runner
from noetl_celery.compiler import compile_source
from noetl_celery.store import repo, views
from noetl_celery.store.db import transaction
from tests.support.harness import Harness, run_playbook
from tests.support.playbooks import range_loop

N = 20

PLAYBOOK = range_loop("pipeline_rows", workload="{n: 20}", max_in_flight=5, tool="__TASKS__\n")


def _task(label: str, code: str) -> str:
    return f'      - {label}:\n          kind: python\n          args: {{x: "{{{{ iter.x }}}}"}}\n          code: "{code}"\n'


def _iteration_rows(tmp_path: Path, tasks: int) -> Counter:
    """Event types of the loop's iterations (rows with an iteration index) for a body of `tasks`."""
    body = "".join(_task(f"t{k}", f"result = x + {k}") for k in range(tasks))
    path = tmp_path / f"pipeline_{tasks}.yaml"
    path.write_text(PLAYBOOK.replace("__TASKS__", body))
    url = f"sqlite:///{tmp_path / f'rows_{tasks}.sqlite'}"
    code, status = run_playbook(url, path)
    assert code == 0 and status["status"] == "completed", status
    assert [r for r in status["results"]["work"]["results"]] == [i + tasks - 1 for i in range(N)]
    with transaction(url) as conn:
        events = repo.list_events(conn, status["execution_id"])
    return Counter(e["event_type"] for e in events if e.get("iteration") is not None)


def test_a_loop_iteration_costs_two_rows_and_each_further_pipeline_task_one(tmp_path: Path) -> None:
    one = _iteration_rows(tmp_path, 1)
    assert one == {"iteration.started": N, "iteration.completed": N}, one
    three = _iteration_rows(tmp_path, 3)
    # the first and the middle task's outcomes, the last task's outcome as the iteration's end
    assert three == {"iteration.started": N, "action.completed": 2 * N, "iteration.completed": N}, three
    assert sum(three.values()) - sum(one.values()) == 2 * N  # one row per further task


def test_an_iteration_writes_the_loop_counters_only_and_the_rate_runs_to_now_or_the_end(tmp_path: Path) -> None:
    """An iteration's update of the loop row leaves `updated_at` alone (its WAL record then holds
    the counters, not the row up to its last column); the loop's rate is measured to now while
    it runs and to its completion after."""
    path = tmp_path / "counters.yaml"
    path.write_text(PLAYBOOK.replace("__TASKS__", _task("t0", "result = x")))
    url = f"sqlite:///{tmp_path / 'counters.sqlite'}"
    plan = compile_source(str(path), {}, runner.catalog(url))
    harness = Harness(url)
    execution_id = harness.start(plan)
    while harness.step():
        with transaction(url) as conn:
            [loop] = repo.execution_loops(conn, execution_id) or [None]
        if loop is not None and 0 < loop["done"] < N:
            break
    assert loop is not None and 0 < loop["done"] < N
    assert loop["updated_at"] == loop["created_at"]  # counted, not stamped
    with transaction(url) as conn:
        [running] = views.loops(conn, execution_id)
    assert running["status"] == "running" and running["rate"] is not None and running["rate"] > 0
    harness.drain()
    with transaction(url) as conn:
        [done] = views.loops(conn, execution_id)
        [row] = repo.execution_loops(conn, execution_id)
    assert done["status"] == "completed" and done["done"] == N
    assert row["updated_at"] > row["created_at"]  # stamped when it completed
    elapsed = (row["updated_at"] - row["created_at"]).total_seconds()
    assert done["rate"] == round(N / elapsed, 2)
