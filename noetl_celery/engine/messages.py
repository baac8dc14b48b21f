"""What travels through the broker: task messages, dispatch orders, and what event rows keep of them.

A task message carries its own iteration element, never the loop's collection, and no tool
configuration (workers read the plan, cached per process, by execution id).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, replace
from typing import Any

CONTEXT_VALUE_LIMIT = 2048  # characters of one value kept in an event row's `context`


@dataclass(frozen=True)
class TaskMessage:
    """One attempt of one task of one step run (or of one loop iteration)."""

    execution_id: int
    run_id: str
    step: str
    task_index: int = 0
    seq: int = 0  # hops within the unit: next task, jump, next page
    attempt: int = 1
    page: int = 1
    iteration: int | None = None
    element: Any = None
    iter_vars: dict[str, Any] = field(default_factory=dict)
    prev: Any = None
    args: dict[str, Any] = field(default_factory=dict)
    call: dict[str, Any] = field(default_factory=dict)  # pagination: next_call overrides
    task_results: dict[str, Any] = field(default_factory=dict)
    frames: list[list[str]] = field(default_factory=list)  # open forks: [fork_id, join_step]
    version: int = 0  # execution state version the decision saw
    parent_event_id: str | None = None
    replay: bool = False

    def evolve(self, **changes: Any) -> TaskMessage:
        return replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> TaskMessage:
        return cls(**data)

    def describe(self) -> str:
        """Shown in Flower's args column: which attempt of which unit this is."""
        parts = [f"execution={self.execution_id}", f"step={self.step}", f"attempt={self.attempt}"]
        if self.iteration is not None:
            parts.append(f"iteration={self.iteration}")
        if self.page > 1:
            parts.append(f"page={self.page}")
        return " ".join(parts)


@dataclass(frozen=True)
class Dispatch:
    """An order to publish: a task attempt for a worker (`run`), after `countdown` seconds."""

    kind: str
    message: dict[str, Any]
    countdown: float = 0.0
    label: str = ""

    @classmethod
    def task(cls, message: TaskMessage, *, countdown: float = 0.0, label: str = "") -> Dispatch:
        return cls(kind="run", message=message.to_dict(), countdown=countdown, label=label)

    def with_version(self, version: int) -> Dispatch:
        return replace(self, message={**self.message, "version": version})

    def as_replay(self) -> Dispatch:
        return replace(self, message={**self.message, "replay": True}, countdown=0.0)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Dispatch:
        return cls(**data)


def _truncate(value: Any) -> Any:
    text = json.dumps(value, default=str)
    if len(text) <= CONTEXT_VALUE_LIMIT:
        return value
    return {"truncated": True, "size": len(text), "preview": text[:200]}


def sanitize(values: dict[str, Any]) -> dict[str, Any] | None:
    """Values for an event row's `context`: Nones dropped, large values replaced by their size."""
    kept = {k: _truncate(v) for k, v in values.items() if v is not None}
    return kept or None
