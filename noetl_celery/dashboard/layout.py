"""Where things are drawn: the playbook graph (steps in columns by distance from the entry step)
and the timeline of attempts (one lane per step and worker). Pure functions over plain data."""

from __future__ import annotations

from collections import deque
from datetime import datetime
from typing import Any

NODE_WIDTH = 170  # px
NODE_HEIGHT = 46  # px
COLUMN_GAP = 60  # px between columns of steps
ROW_GAP = 22  # px between steps of one column
MARGIN = 12  # px around the drawing
LANE_HEIGHT = 18  # px per timeline lane
LANE_LABEL_WIDTH = 220  # px of lane names left of the timeline
TIMELINE_WIDTH = 760  # px of the time axis
STATE_COLOURS = {
    "completed": "#2e9e5b",
    "failed": "#d64545",
    "running": "#e0a526",
    "skipped": "#9aa3ad",
    "pending": "#e8ecf0",
    "waiting": "#7aa7d6",
}


def graph(
    plan: dict[str, Any], states: dict[str, dict[str, Any]], loops: list[dict[str, Any]], joins: list[dict[str, Any]]
) -> dict[str, Any]:
    """{width, height, nodes: [{name, x, y, state, colour, loop, join}], edges: [{x1, y1, x2, y2}]}."""
    steps: dict[str, Any] = plan.get("steps") or {}
    depth = _depths(plan.get("entry_step"), steps)
    columns: dict[int, list[str]] = {}
    for name in steps:
        columns.setdefault(depth.get(name, max(depth.values(), default=0) + 1), []).append(name)
    latest_loop = {loop["step"]: loop for loop in loops}  # the last instance of each loop step
    waiting = {j["join_step"]: j for j in joins if j["arrived"] < j["width"]}
    nodes: dict[str, dict[str, Any]] = {}
    for col, names in sorted(columns.items()):
        for row, name in enumerate(names):
            state = states.get(name, {}).get("state", "pending")
            if state == "pending" and name in waiting:
                state = "waiting"
            nodes[name] = {
                "name": name,
                "state": state,
                "colour": STATE_COLOURS[state],
                "x": MARGIN + col * (NODE_WIDTH + COLUMN_GAP),
                "y": MARGIN + row * (NODE_HEIGHT + ROW_GAP),
                "loop": latest_loop.get(name),
                "is_loop": bool(steps[name].get("loop")),
                "join": waiting.get(name),
                "joins_at": steps[name].get("join"),
                "runs": states.get(name, {}).get("runs", 0),
            }
    edges = []
    for name, step in steps.items():
        for arc in (step.get("next") or {}).get("arcs", []):
            target = nodes.get(arc.get("step"))
            if target is None:
                continue
            source = nodes[name]
            edges.append(
                {
                    "x1": source["x"] + NODE_WIDTH,
                    "y1": source["y"] + NODE_HEIGHT / 2,
                    "x2": target["x"],
                    "y2": target["y"] + NODE_HEIGHT / 2,
                    "back": target["x"] <= source["x"],
                    "when": arc.get("when"),
                }
            )
    width = MARGIN * 2 + (max(columns, default=0) + 1) * (NODE_WIDTH + COLUMN_GAP)
    height = MARGIN * 2 + max((len(v) for v in columns.values()), default=1) * (NODE_HEIGHT + ROW_GAP)
    return {
        "width": width,
        "height": height,
        "nodes": list(nodes.values()),
        "edges": edges,
        "node_width": NODE_WIDTH,
        "node_height": NODE_HEIGHT,
    }


def _depths(entry: str | None, steps: dict[str, Any]) -> dict[str, int]:
    """Breadth-first distance of each step from the entry (each step placed once; cycles ignored)."""
    if not entry or entry not in steps:
        return {name: i for i, name in enumerate(steps)}
    depth = {entry: 0}
    queue = deque([entry])
    while queue:
        name = queue.popleft()
        for arc in (steps[name].get("next") or {}).get("arcs", []):
            target = arc.get("step")
            if target in steps and target not in depth:
                depth[target] = depth[name] + 1
                queue.append(target)
    return depth


def timeline(attempts: list[dict[str, Any]]) -> dict[str, Any]:
    """{width, height, lanes: [names], bars: [{x, y, w, colour, title, ...}], span_s}."""
    timed = [a for a in attempts if isinstance(a.get("started_at"), datetime)]
    if not timed:
        return {"width": LANE_LABEL_WIDTH + TIMELINE_WIDTH, "height": 0, "lanes": [], "bars": [], "span_s": 0}
    start = min(_naive(a["started_at"]) for a in timed)
    end = max(_naive(a["started_at"]).timestamp() + (a.get("duration_ms") or 0) / 1000 for a in timed)
    span = max(end - start.timestamp(), 0.001)
    lanes: list[str] = []
    bars = []
    for a in timed:
        lane = f"{a['step']} @ {a.get('worker') or '?'}"
        if lane not in lanes:
            lanes.append(lane)
        offset = (_naive(a["started_at"]) - start).total_seconds()
        bars.append(
            {
                "x": LANE_LABEL_WIDTH + offset / span * TIMELINE_WIDTH,
                "y": lanes.index(lane) * LANE_HEIGHT + 2,
                "w": max((a.get("duration_ms") or 0) / 1000 / span * TIMELINE_WIDTH, 2.0),
                "colour": STATE_COLOURS["failed" if a.get("status") == "failed" else "completed"],
                "title": (
                    f"{a['step']} it={a.get('iteration')} attempt={a.get('attempt')} "
                    f"{a.get('duration_ms') or 0:.1f} ms on {a.get('worker')} task {a.get('queue_id')}"
                ),
            }
        )
    return {
        "width": LANE_LABEL_WIDTH + TIMELINE_WIDTH + MARGIN,
        "height": len(lanes) * LANE_HEIGHT + 4,
        "lanes": lanes,
        "bars": bars,
        "span_s": round(span, 3),
        "lane_height": LANE_HEIGHT,
        "label_width": LANE_LABEL_WIDTH,
    }


def _naive(value: datetime) -> datetime:
    return value.replace(tzinfo=None)
