"""Where the conformance corpus (real NoETL playbooks) is, and which tests use it.

The corpus is not part of this repository: NOETL_CORPUS_DIR names it (default: the folder
`../shared/noetl-corpus` beside the checkout). Tests that need it skip with a reason that says
so, and the terminal summary counts how many conformance cases ran or skipped and why.
"""

from __future__ import annotations

import inspect
import re
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from noetl_celery.config import settings

CORPUS: Path = settings.load().corpus_dir
MISSING_REASON = f"no NoETL corpus at {CORPUS} (set {settings.CORPUS_DIR_ENV})"
_USES_CORPUS = re.compile(r"\bCORPUS\b|\bcorpus\(")


def corpus_file(name: str) -> Path:
    """The corpus file `name`; the test skips (saying where it looked) when it is absent."""
    path = CORPUS / name
    if not path.exists():
        pytest.skip(f"corpus file {path} not present" if CORPUS.is_dir() else MISSING_REASON)
    return path


def uses_corpus(item: Any) -> bool:
    """A conformance case: a test of a corpus module, or one whose body reads the corpus."""
    module = getattr(item, "module", None)
    if module is not None and "corpus" in module.__name__.rsplit(".", 1)[-1]:
        return True
    function = getattr(item, "function", None)
    try:
        source = inspect.getsource(function) if function is not None else ""
    except (OSError, TypeError):
        return False
    return bool(_USES_CORPUS.search(source))


CONFORMANCE_MARK = "conformance"  # the marker collection gives each case (see uses_corpus)


class ConformanceTally:
    """Outcomes of the conformance cases of one session, for the terminal summary."""

    def __init__(self) -> None:
        self.nodeids: set[str] = set()
        self.outcomes: Counter[str] = Counter()
        self.skip_reasons: Counter[str] = Counter()

    def add(self, report: Any) -> None:
        """Count a test report of a case marked `conformance` (also one from a pytest-xdist worker:
        reports carry their item's keywords)."""
        if CONFORMANCE_MARK not in report.keywords:
            return
        self.nodeids.add(report.nodeid)
        if report.when == "call" or (report.when == "setup" and not report.passed):
            if report.skipped:
                self.outcomes["skipped"] += 1
                reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
                self.skip_reasons[reason.removeprefix("Skipped: ")] += 1
            else:
                self.outcomes[report.outcome] += 1

    def lines(self) -> list[str]:
        ran = self.outcomes["passed"] + self.outcomes["failed"]
        head = (
            f"{len(self.nodeids)} conformance cases (NoETL corpus at {CORPUS}): {ran} ran "
            f"({self.outcomes['passed']} passed, {self.outcomes['failed']} failed), "
            f"{self.outcomes['skipped']} skipped"
        )
        lines = [head]
        lines += [f"  skipped {count}x: {reason}" for reason, count in self.skip_reasons.most_common(5)]
        if not CORPUS.is_dir():
            lines.append(
                f"  to run them: {settings.CORPUS_DIR_ENV}=<a NoETL checkout>/tests/fixtures/playbooks "
                "(see README, Tests)"
            )
        return lines


# --------------------------------------------------------------------------- building the corpus

INDEX = Path(__file__).resolve().parents[1] / "corpus" / "INDEX.tsv"  # file -> source repo@commit:path


def build(checkouts: dict[str, Path], out: Path, index: Path = INDEX) -> tuple[int, list[str]]:
    """Write the corpus laid out as INDEX.tsv says, each file taken with `git show` from the
    commit it names in a local clone of its repository (`checkouts`: "noetl/noetl" -> path).
    Returns (files written, what could not be had)."""
    import shutil
    import subprocess

    header, *rows = index.read_text(encoding="utf-8").splitlines()
    names = header.split("\t")
    written, missing = 0, []
    for line in rows:
        if not line.strip():
            continue
        row = dict(zip(names, line.split("\t"), strict=False))
        repo, _, commit = row["source_repo@commit"].partition("@")
        clone = checkouts.get(repo)
        if clone is None:
            missing.append(f"{row['file']}: no clone of {repo} given")
            continue
        proc = subprocess.run(
            ["git", "-C", str(clone), "show", f"{commit}:{row['source_path']}"], capture_output=True, timeout=60
        )
        if proc.returncode != 0:
            missing.append(f"{row['file']}: {repo}@{commit}:{row['source_path']} not in {clone}")
            continue
        target = out / row["file"]
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(proc.stdout)
        written += 1
    out.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(index, out / "INDEX.tsv")
    return written, missing


def main(argv: list[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(
        prog="python -m tests.support.corpus",
        description="Lay out the conformance corpus from local clones of NoETL's repositories.",
    )
    parser.add_argument("--noetl", type=Path, required=True, help="a full clone of noetl/noetl")
    parser.add_argument("--e2e", type=Path, help="a full clone of noetl/e2e (one cursor playbook)")
    parser.add_argument("--out", type=Path, default=CORPUS, help=f"where to write it (default {CORPUS})")
    args = parser.parse_args(argv)
    checkouts = {"noetl/noetl": args.noetl, **({"noetl/e2e": args.e2e} if args.e2e else {})}
    written, missing = build(checkouts, args.out)
    print(f"{written} playbooks written to {args.out}")
    for problem in missing:
        print(f"  missing: {problem}")
    print(f"run the conformance tests with {settings.CORPUS_DIR_ENV}={args.out}")
    return 0 if written else 1


if __name__ == "__main__":
    raise SystemExit(main())
