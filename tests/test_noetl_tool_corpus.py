"""How many real NoETL playbooks that use the tools of issue 38 validate here: the committed
copies in tests/corpus/noetl-public/tools (each file whole, its source repository, path and
commit in its first line and in INDEX.tsv).

INDEX.tsv says, for each file, the tool kinds it uses and what validate must answer:
- `validates`: no problem at all;
- `pending:<kinds>`: a kind not run here yet (none is now: shell and snowflake landed); the file must be refused
  for exactly that kind's "cannot run here" line and nothing else, and a file that validates
  fails this test, so the mark is removed when the kind lands;
- `refused:<kinds>`: a kind that cannot run on a worker of ours by design (container, rhai,
  agent, ollama_bridge, ibkr, gke, and `kind: script`, a Kubernetes Job); refused with the one-line "cannot run here: <why>; <what
  to use instead>" sentence and nothing else;
- `broken:<reason>`: the file is wrong in NoETL too (the reason says how); it must be refused.
The figure (as-is, and with any pending kind landed) is printed with `-s`.
"""

from __future__ import annotations

import csv
import re
from dataclasses import dataclass
from pathlib import Path

import pytest

from noetl_celery.core.errors import PlaybookError, Problem
from noetl_celery.dsl import load_plan

TOOLS = Path(__file__).parent / "corpus" / "noetl-public" / "tools"
PENDING_KINDS: set[str] = set()  # a kind still to land; shell and snowflake have
REFUSED_KINDS = {"container", "rhai", "agent", "ollama_bridge", "ibkr", "gke", "script"}  # script: a Kubernetes Job
CANNOT_RUN_HERE = re.compile(r"^tool kind '(?P<kind>[a-z_]+)' cannot run here: (?P<why>[^\n]+)$")
WHY_AND_INSTEAD = re.compile(r"^[^;]+; [^;]+$")  # "<why>; <what to use instead>"
# a transfer endpoint of a pending kind is refused as an endpoint the tool lacks
PENDING_ENDPOINT = re.compile(r"^(source|target)\.type '(?P<kind>[a-z_]+)' is not an endpoint this tool has")
HEADER = re.compile(r"^# source: (?P<repo>\S+) (?P<path>\S+) @ (?P<commit>[0-9a-f]{40})$")


@dataclass(frozen=True)
class Entry:
    file: str
    repo: str
    path: str
    commit: str
    kinds: tuple[str, ...]
    expect: str

    @property
    def verdict(self) -> str:
        return self.expect.split(":", 1)[0]

    @property
    def marked(self) -> set[str]:
        return set(self.expect.split(":", 1)[1].split(",")) if self.verdict in ("pending", "refused") else set()


def entries() -> dict[str, Entry]:
    with (TOOLS / "INDEX.tsv").open() as handle:
        rows = list(csv.DictReader(handle, delimiter="\t"))
    return {
        row["file"]: Entry(
            row["file"], row["repo"], row["path"], row["commit"], tuple(row["kinds"].split(",")), row["expect"]
        )
        for row in rows
    }


def problems_of(path: Path) -> list[Problem]:
    try:
        load_plan(path)
    except PlaybookError as exc:
        return list(exc.problems)
    return []


def test_the_index_lists_every_file_with_the_source_its_header_names() -> None:
    index = entries()
    assert set(index) == {path.name for path in TOOLS.glob("*.yaml")}
    for name, entry in index.items():
        header = HEADER.match((TOOLS / name).read_text().splitlines()[0])
        assert header, f"{name}: first line must be '# source: <repo> <path> @ <commit>'"
        assert (header["repo"], header["path"], header["commit"]) == (entry.repo, entry.path, entry.commit), name
        assert entry.verdict in ("validates", "pending", "refused", "broken"), name
        assert entry.marked <= set(entry.kinds), f"{name}: marks a kind it does not list"
        if entry.verdict == "pending":
            assert entry.marked <= PENDING_KINDS, name
        if entry.verdict == "refused":
            assert entry.marked <= REFUSED_KINDS | PENDING_KINDS and entry.marked & REFUSED_KINDS, name


@pytest.mark.parametrize("name", sorted(entries()))
def test_a_real_playbook_validates_or_is_refused_for_its_marked_reason(name: str) -> None:
    entry = entries()[name]
    problems = problems_of(TOOLS / name)
    if entry.verdict == "validates":
        assert problems == [], [str(p) for p in problems]
        return
    assert problems, f"{name} validates now: mark it 'validates' in INDEX.tsv (it was {entry.expect})"
    if entry.verdict == "broken":
        return
    unexplained = [str(p) for p in problems if _refused_kind(p) not in entry.marked]
    assert unexplained == [], unexplained
    if entry.verdict == "refused":
        assert {_refused_kind(p) for p in problems} & REFUSED_KINDS, [str(p) for p in problems]


def _refused_kind(problem: Problem) -> str | None:
    """The kind a problem refuses: "cannot run here" (for a kind refused by design, with what
    to use instead), or a pending kind's transfer endpoint; None for any other problem."""
    match = CANNOT_RUN_HERE.match(problem.message)
    if match and (match["kind"] not in REFUSED_KINDS or WHY_AND_INSTEAD.match(match["why"])):
        return match["kind"]
    endpoint = PENDING_ENDPOINT.match(problem.message)
    return endpoint["kind"] if endpoint and endpoint["kind"] in PENDING_KINDS else None


def test_report_how_many_tool_playbooks_validate() -> None:
    index = entries()
    valid = [name for name in index if not problems_of(TOOLS / name)]
    pending = [name for name, e in index.items() if e.verdict == "pending"]
    refused = [name for name, e in index.items() if e.verdict == "refused"]
    broken = [name for name, e in index.items() if e.verdict == "broken"]
    runnable = len(index) - len(refused)  # what a worker of ours is meant to run
    once_landed = len(valid) + len(pending)
    print(
        f"\nreal NoETL tool playbooks: {len(valid)} of {len(index)} validate as-is; "
        f"{once_landed} of {runnable} runnable here "
        f"({100 * once_landed / max(runnable, 1):.0f}%); refused by design {len(refused)}; "
        f"broken in NoETL too {len(broken)}: {', '.join(broken) or '-'}"
    )
    assert len(valid) == sum(1 for e in index.values() if e.verdict == "validates")
