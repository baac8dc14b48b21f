"""How many real NoETL playbooks validate here (issue 39): the committed copies of NoETL's public
fixtures (tests/corpus/noetl-public, sources in its INDEX.tsv) and the shared corpus.

Every file validates, except the files INDEX.tsv marks with a feature this engine does not run
yet (`kinds_pending`: a tool kind or a credential provider): those must be refused for exactly
that reason, and nothing else, so that this test tightens when the feature lands (the file then
validates and its mark must be removed). The figure is printed with `-s`.
"""

from __future__ import annotations

import csv
from pathlib import Path

import pytest

from noetl_celery.core.errors import PlaybookError, Problem
from noetl_celery.dsl import load_plan
from tests.support.corpus import CORPUS

PUBLIC = Path(__file__).parent / "corpus" / "noetl-public"
# what refuses a file of a pending feature, by the feature's name in INDEX.tsv (one of them)
PENDING_REASONS: dict[str, str | tuple[str, ...]] = {
    "shell": "tool kind 'shell' cannot run here",
    "transfer": "tool kind 'transfer' cannot run here",
    "gcs": "tool kind 'gcs' cannot run here",
    "s3": "tool kind 's3'",
    "snowflake": ("tool kind 'snowflake' cannot run here", "type 'snowflake' is not an endpoint this tool has"),
    "ducklake": "tool kind 'ducklake' cannot run here",
    "artifact": "tool kind 'artifact' cannot run here",
    "mcp": "tool kind 'mcp'",
    "container": "tool kind 'container' cannot run here",
    "secret_manager": "is a cloud secret manager",
}


def index() -> dict[str, list[str]]:
    with (PUBLIC / "INDEX.tsv").open() as handle:
        rows = list(csv.DictReader(handle, delimiter="\t"))
    return {row["file"]: [kind for kind in (row["kinds_pending"] or "").split(",") if kind] for row in rows}


def problems_of(path: Path) -> list[Problem]:
    try:
        load_plan(path)
    except PlaybookError as exc:
        return list(exc.problems)
    return []


def test_the_index_lists_every_committed_file_with_its_source() -> None:
    assert set(index()) == {path.name for path in PUBLIC.glob("*.yaml")}
    assert all(kind in PENDING_REASONS for kinds in index().values() for kind in kinds)


@pytest.mark.parametrize("name", sorted(index()))
def test_a_public_noetl_playbook_validates_unless_its_feature_is_pending(name: str) -> None:
    pending = index()[name]
    problems = problems_of(PUBLIC / name)
    if not pending:
        assert problems == [], [str(p) for p in problems]
        return
    assert problems, f"{name} validates now: remove its kinds_pending mark ({', '.join(pending)}) from INDEX.tsv"
    reasons = [r for kind in pending for r in _reasons(kind)]
    unexplained = [str(p) for p in problems if not any(reason in p.message for reason in reasons)]
    assert unexplained == [], unexplained


def _reasons(kind: str) -> tuple[str, ...]:
    reason = PENDING_REASONS[kind]
    return (reason,) if isinstance(reason, str) else reason


def test_report_how_many_real_playbooks_validate(capsys) -> None:
    files = sorted(PUBLIC.glob("*.yaml"))
    if CORPUS.is_dir():
        files += [path for path in sorted(CORPUS.rglob("*.yaml")) if not path.name.startswith("broken_")]
    valid = [path for path in files if not problems_of(path)]
    pending = [path for path in files if path.parent == PUBLIC and index()[path.name]]
    with capsys.disabled():
        print(
            f"\nreal NoETL playbooks: {len(valid)} of {len(files)} validate "
            f"({len(pending)} use a feature not run here yet: "
            f"{', '.join(sorted({k for p in pending for k in index()[p.name]}))})"
        )
    assert len(valid) == len(files) - len(pending)
