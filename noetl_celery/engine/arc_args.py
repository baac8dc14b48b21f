"""Arc args: how the `args` an arc carries reach the tasks of the step it enters.

NoETL merges an arc's args into the target step's args: a step that declares
`args: {x: null}` and is entered by `next: [{step: b, args: {x: 41}}]` runs with `x = 41`.
The arc's values win over the step's own. They are merged after the step's args were rendered
(they are values already rendered when the arc fired, never rendered again), into every task
that takes args: python (its `main()` arguments), noop and its aliases (their result), and any
task whose configuration declares `args`, except a postgres table write, where `args` are the
columns of the row (an arc's args stay available there as `{{ args.x }}`).
"""

from __future__ import annotations

from typing import Any

ARGS_KINDS = frozenset({"python", "noop", "end", "router", "start"})  # kinds whose args are inputs


def takes_arc_args(kind: str, config: dict[str, Any]) -> bool:
    if "table" in config:
        return False
    return kind in ARGS_KINDS or "args" in config


def merge_arc_args(kind: str, rendered: dict[str, Any], arc_args: dict[str, Any]) -> dict[str, Any]:
    """`rendered` (a task's rendered configuration) with `arc_args` merged over its `args`."""
    if not arc_args or not takes_arc_args(kind, rendered):
        return rendered
    own = rendered.get("args")
    if own is not None and not isinstance(own, dict):
        return rendered  # the tool reports args of the wrong shape itself
    return {**rendered, "args": {**(own or {}), **arc_args}}
