"""Rows per unit of work (the store's cost of a loop): a loop iteration writes its start and its
end, and each further task of its pipeline one row more (its outcome; the previous task's outcome
row is its start). Run in-process on the harness, on SQLite."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

from noetl_celery.store import repo
from noetl_celery.store.db import transaction
from tests.support.harness import run_playbook
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
