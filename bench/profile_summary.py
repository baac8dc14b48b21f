"""Summarise py-spy raw (collapsed) profiles of worker children: where a worker's time goes.

    python -m bench.profile_summary DIR_OR_FILES... [--top 25] [--prefix inline-1w]

Each input line is ``frame;frame;...;frame COUNT`` (``py-spy record -f raw``). Prints, over all
the files given: the share of samples inside a Celery job (py-spy counts only samples where the
thread is active unless it ran with --idle), and for those the inclusive share of a few known
phases of a noetl task, the top functions by self time and by inclusive time.
"""

from __future__ import annotations

import argparse
import re
import sys
from collections import Counter
from pathlib import Path

# Inclusive phases of interest (a frame whose text contains the key).
PHASES = [
    ("run_task (the whole Celery job)", "run_task (noetl_celery/engine/transport/attempts.py"),
    ("  worker.execute (tool call incl. state and rendering)", "execute (noetl_celery/engine/attempt/worker.py"),
    ("  process_event (on_event body)", "process_event (noetl_celery/engine/transport/deciding.py"),
    ("    orchestrator.handle_event", "handle_event (noetl_celery/engine/decision/orchestrator.py"),
    ("      transaction commit", "commit (sqlalchemy"),
    ("    publish (apply_async of the next task)", "publish (noetl_celery/engine/transport/publish.py"),
    ("on_event (the Celery job, queue mode)", "on_event (noetl_celery/engine/transport/deciding.py"),
    ("send_event (queue mode: outcome to the on_event queue)", "send_event (noetl_celery/engine/transport/publish.py"),
    ("psycopg2 execute (any SQL, incl. waiting for PostgreSQL)", "execute (sqlalchemy/engine/default.py"),
    ("kombu publish (any message sent)", "_publish (kombu/messaging.py"),
    ("celery trace outside the task body", "trace_task (celery/app/trace.py"),
]
LINE_RE = re.compile(r"^(.*) (\d+)$")


def short(frame: str) -> str:
    """'func (path/to/site-packages/pkg/mod.py:123)' -> 'func (pkg/mod.py)'."""
    m = re.match(r"^(.*?) \((.*?)(?::\d+)?\)$", frame)
    if not m:
        return frame
    func, path = m.groups()
    for marker in ("site-packages/", "lib/python3", "/work/main/"):
        if marker in path:
            path = path.split(marker, 1)[1]
            break
    if path.startswith(".") or re.match(r"^\.\d+/", path):
        path = path.split("/", 1)[-1]
    return f"{func} ({path})"


def load(paths: list[Path]) -> list[tuple[list[str], int]]:
    stacks = []
    for path in paths:
        for line in path.read_text(errors="replace").splitlines():
            m = LINE_RE.match(line.strip())
            if not m:
                continue
            frames = [short(f) for f in m.group(1).split(";")]
            stacks.append((frames, int(m.group(2))))
    return stacks


def in_job(frames: list[str]) -> bool:
    """True for a sample taken inside a Celery job (the task's trace), not the pool's own loop."""
    return any(f.startswith(("fast_trace_task ", "build_tracer.<locals>.trace_task ")) for f in frames)


def summarise(stacks: list[tuple[list[str], int]], top: int) -> str:
    total = sum(c for _, c in stacks)
    if not total:
        return "no samples"
    busy = [(f, c) for f, c in stacks if in_job(f)]
    busy_total = sum(c for _, c in busy) or 1
    out = [
        f"samples: {total}; inside a Celery job: {busy_total} ({100 * busy_total / total:.1f} %), "
        f"in the pool's own loop: {total - busy_total} ({100 * (total - busy_total) / total:.1f} %)",
        "",
    ]
    out.append("phases (inclusive, % of busy samples):")
    for label, key in PHASES:
        n = sum(c for f, c in busy if any(_match(fr, key) for fr in f))
        if n:
            out.append(f"  {100 * n / busy_total:5.1f} %  {label}")
    self_time: Counter[str] = Counter()
    incl: Counter[str] = Counter()
    for frames, c in busy:
        self_time[frames[-1]] += c
        for fr in set(_below_task(frames)):
            incl[fr] += c
    out += ["", f"top {top} by self time (% of busy samples):"]
    out += [f"  {100 * c / busy_total:5.1f} %  {fr}" for fr, c in self_time.most_common(top)]
    out += ["", f"top {top} by inclusive time, frames below the trace (% of samples in a job):"]
    out += [f"  {100 * c / busy_total:5.1f} %  {fr}" for fr, c in incl.most_common(top)]
    return "\n".join(out)


def _below_task(frames: list[str]) -> list[str]:
    for i, f in enumerate(frames):
        if f.startswith("build_tracer.<locals>.trace_task "):
            return frames[i + 1 :]
    return frames


def focus(stacks: list[tuple[list[str], int]], needle: str, depth: int = 1, top: int = 15) -> str:
    """How the samples under the first frame containing `needle` split among its callees."""
    under: Counter[str] = Counter()
    total = 0
    for frames, c in stacks:
        idx = next((i for i, f in enumerate(frames) if needle in f), None)
        if idx is None:
            continue
        total += c
        callee = " > ".join(frames[idx + 1 : idx + 1 + depth]) or "(self)"
        under[callee] += c
    if not total:
        return f"no sample under {needle!r}"
    lines = [f"under {needle!r}: {total} samples"]
    lines += [f"  {100 * c / total:5.1f} %  {k}" for k, c in under.most_common(top)]
    return "\n".join(lines)


def _match(frame: str, key: str) -> bool:
    func, _, where = key.partition(" (")
    where = where.rstrip(")")
    return frame.startswith(func + " (") and where.split("/")[-1] in frame and where.split("/")[0] in frame


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.profile_summary")
    p.add_argument("paths", nargs="+")
    p.add_argument("--top", type=int, default=25)
    p.add_argument("--prefix", default="", help="only files whose name starts with this")
    p.add_argument(
        "--focus",
        action="append",
        default=[],
        help="also show how the samples under this frame (substring) split among its callees",
    )
    p.add_argument("--depth", type=int, default=1, help="callee levels shown by --focus")
    args = p.parse_args(argv)
    files: list[Path] = []
    for raw in args.paths:
        path = Path(raw)
        files += sorted(path.glob(f"{args.prefix}*.txt")) if path.is_dir() else [path]
    if not files:
        print("no profile files", file=sys.stderr)
        return 1
    print(f"files: {', '.join(f.name for f in files)}")
    stacks = load(files)
    print(summarise(stacks, args.top))
    for needle in args.focus:
        print()
        print(focus(stacks, needle, args.depth, args.top))
    return 0


if __name__ == "__main__":
    sys.exit(main())
