"""A playbook submitted by a relative path, run by a worker in another working directory.

`cd pbs && noetl-celery submit parent.yaml` used to keep `source_file: parent.yaml` in the plan:
the submitting process found what the playbook names relative to its file, the workers (another
working directory) did not: sub-playbooks beside it failed "not found", a `script:` file could not
be read. The plan now keeps the file's absolute path.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from noetl_celery.dsl import load_plan
from noetl_celery.runner import wait
from tests.support.engines import _clean_env

PARENT = """apiVersion: noetl.io/v2
kind: Playbook
metadata: {name: rel_parent}
workload: {n: 3}
workflow:
  - step: start
    loop: {in: "{{ range(n) | list }}", iterator: i, spec: {mode: parallel}}
    tool: {kind: playbook, path: rel/child, return_step: start, input: {x: "{{ iter.i }}"}}
    next:
      arcs: [{step: scripted}]
  - step: scripted
    tool:
      kind: python
      args: {values: "{{ start.results | map(attribute='double') | list }}"}
      script: {uri: scripts/job.py, source: {type: file}}
"""
CHILD = """apiVersion: noetl.io/v2
kind: Playbook
metadata: {name: rel_child, path: rel/child}
workload: {x: 0}
workflow:
  - step: start
    tool: {kind: python, args: {x: "{{ x }}"}, code: "result = {'double': x * 2}"}
"""
JOB = "result = {'from': 'file', 'values': values}\n"


def _write(tmp_path):
    pbs = tmp_path / "pbs"
    (pbs / "scripts").mkdir(parents=True)
    (pbs / "parent.yaml").write_text(PARENT)
    (pbs / "child.yaml").write_text(CHILD)
    (pbs / "scripts" / "job.py").write_text(JOB)
    return pbs


def test_the_plan_keeps_the_absolute_file_of_a_relative_path(tmp_path, monkeypatch):
    pbs = _write(tmp_path)
    monkeypatch.chdir(pbs)
    assert load_plan("parent.yaml").source_file == str(pbs / "parent.yaml")
    assert load_plan("./scripts/../parent.yaml").source_file == str(pbs / "parent.yaml")
    assert load_plan("not-a-file.yaml", text=CHILD).source_file == "not-a-file.yaml"  # a name, kept
    assert load_plan("catalog:rel/child", text=CHILD).source_file == "catalog:rel/child"


@pytest.mark.timeout(300)
def test_a_relative_playbook_path_runs_on_a_worker_elsewhere(tmp_path, env, worker_factory, store_url):
    pbs = _write(tmp_path)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    worker_factory(env=env, concurrency=2, cwd=elsewhere)
    proc = subprocess.run(
        [sys.executable, "-m", "noetl_celery.cli", "submit", "parent.yaml", "--json"],
        env=_clean_env(env),
        capture_output=True,
        text=True,
        timeout=120,
        cwd=pbs,
    )
    assert proc.returncode == 0, proc.stderr
    status = wait(store_url, int(json.loads(proc.stdout)["execution_id"]), timeout=120)
    assert status["status"] == "completed", status
    assert status["results"]["scripted"] == {"from": "file", "values": [0, 2, 4]}
