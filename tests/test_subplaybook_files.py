"""Sub-playbooks named by their file, relative to the parent (issue 39), and a folder scan that no
file of the folder can break. On the in-process harness, SQLite."""

from __future__ import annotations

from pathlib import Path

import pytest

from noetl_celery.compiler import compile_source
from noetl_celery.core.errors import PlaybookError
from noetl_celery.store import db
from tests.support.harness import run_playbook

CHILD = """\
apiVersion: noetl.io/v2
kind: Playbook
metadata: {{name: {name}, path: catalog/{name}}}
workload: {{x: 0}}
workflow:
  - step: start
    tool: {{kind: python, input: {{x: "{{{{ x }}}}"}}, code: "result = {{'x': x, 'from': '{name}'}}"}}
"""

PARENT = """\
apiVersion: noetl.io/v2
kind: Playbook
metadata: {{name: parent}}
workflow:
  - step: start
    tool: {{kind: playbook, path: "{path}", payload: {{x: 7}}}}
"""


@pytest.fixture
def folder(tmp_path: Path) -> Path:
    (tmp_path / "setup").mkdir()
    (tmp_path / "child.yaml").write_text(CHILD.format(name="child"))
    (tmp_path / "setup" / "x.yaml").write_text(CHILD.format(name="x"))
    (tmp_path / "setup" / "y.yml").write_text(CHILD.format(name="y"))
    return tmp_path


@pytest.mark.parametrize(
    "path, child",
    [
        ("./child.yaml", "child"),
        ("child.yaml", "child"),
        ("./child", "child"),
        ("setup/x.yaml", "x"),
        ("setup/x", "x"),
        ("setup/y", "y"),
        ("catalog/child", "child"),  # today's lookup by metadata.path still works
    ],
)
def test_a_sub_playbook_is_found_by_its_file_beside_the_parent(folder, path, child) -> None:
    parent = folder / "parent.yaml"
    parent.write_text(PARENT.format(path=path))
    url = f"sqlite:///{folder / 'events.sqlite'}"
    db.migrate(url)
    code, status = run_playbook(url, parent)
    assert code == 0, status
    assert status["results"]["start"] == {"start": {"x": 7, "from": child}}


def test_a_sub_playbook_file_in_a_subfolder_finds_its_own_children_beside_it(folder) -> None:
    (folder / "setup" / "outer.yaml").write_text(PARENT.format(path="./x.yaml").replace("parent", "outer"))
    parent = folder / "parent.yaml"
    parent.write_text(PARENT.format(path="setup/outer.yaml"))
    url = f"sqlite:///{folder / 'events.sqlite'}"
    db.migrate(url)
    code, status = run_playbook(url, parent)
    assert code == 0, status
    assert status["results"]["start"] == {"start": {"start": {"x": 7, "from": "x"}}}


def test_a_missing_file_is_named_with_its_line(folder) -> None:
    parent = folder / "parent.yaml"
    parent.write_text(PARENT.format(path="./nowhere.yaml"))
    with pytest.raises(PlaybookError) as raised:
        compile_source(str(parent))
    (problem,) = raised.value.problems
    assert (problem.line, problem.path) == (6, "start.tool.path")
    assert "sub-playbook './nowhere.yaml' not found" in problem.message


def test_a_hostile_file_in_the_folder_does_not_break_a_missing_sub_playbook(folder) -> None:
    """A YAML file nested 5000 levels, one with a NUL byte and one over the size limit sit beside
    the parent: the missing child is still reported cleanly (they are never parsed for their
    metadata.path, or are read within the limits)."""
    (folder / "deep.yaml").write_text("metadata: {path: catalog/missing}\nx: " + "[" * 5000 + "]" * 5000 + "\n")
    (folder / "nul.yaml").write_bytes(b"metadata: {path: catalog/missing\x00}\n")
    (folder / "big.yaml").write_text("metadata: {path: catalog/missing}\n#" + "x" * 5_000_000 + "\n")
    parent = folder / "parent.yaml"
    parent.write_text(PARENT.format(path="catalog/missing"))
    with pytest.raises(PlaybookError) as raised:
        compile_source(str(parent))
    (problem,) = raised.value.problems
    assert "sub-playbook 'catalog/missing' not found" in problem.message


def test_a_child_file_that_cannot_be_read_is_a_problem_not_a_crash(folder) -> None:
    (folder / "broken.yaml").write_text("x: " + "[" * 5000 + "]" * 5000 + "\n")
    parent = folder / "parent.yaml"
    parent.write_text(PARENT.format(path="./broken.yaml"))
    with pytest.raises(PlaybookError) as raised:
        compile_source(str(parent))
    (problem,) = raised.value.problems
    assert "sub-playbook './broken.yaml' is invalid" in problem.message
    assert "NOETL_MAX_INPUT_DEPTH" in problem.message
