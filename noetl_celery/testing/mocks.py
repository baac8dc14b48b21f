"""Tool mocks for playbook tests: what a step's (or a tool kind's) call returns instead of running.

A mock is keyed by step name (`"fetch"`) or by tool kind (`"kind:http"`); a step's key wins. Its
value is what the call returns (any JSON value: the step's result), or one of:
- `fails(kind, message, retryable=False)`: the call fails, as a tool's error would;
- `sequence(a, b, ...)`: successive calls take the next value (the last one repeats), e.g. a
  failure then a success to exercise a retry policy;
- a function of the `ToolCall` (its rendered `config`, `context`, ...) returning either of the
  above or a value.
Every mocked call's rendered config is kept in `ToolMocks.calls[step]`, to assert what was sent.
A step without a mock runs its real tool. Mocks act on the harness only (this process, one call
at a time); nothing of this module is on a worker's path.
"""

from __future__ import annotations

import contextlib
import threading
from collections import defaultdict
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from noetl_celery.engine.attempt import worker
from noetl_celery.tools.base import Outcome, ToolCall

KIND_PREFIX = "kind:"


@dataclass(frozen=True)
class Failure:
    """A mocked tool failure (see `fails`)."""

    kind: str
    message: str
    retryable: bool = False
    error: Mapping[str, Any] = field(default_factory=dict)

    def outcome(self) -> Outcome:
        return Outcome.fail(self.kind, self.message, self.retryable, **dict(self.error))


def fails(kind: str, message: str, retryable: bool = False, **error: Any) -> Failure:
    """A call that fails with error `kind` (e.g. "http", "timeout") and `message`; `error`: more
    fields of the error as the tool would give them (`status=503` is `{{ error.status }}`)."""
    return Failure(kind, message, retryable, error)


@dataclass
class Sequence:
    """Successive calls take successive values; the last one repeats (see `sequence`)."""

    values: tuple[Any, ...]
    taken: int = 0

    def next_value(self) -> Any:
        value = self.values[min(self.taken, len(self.values) - 1)]
        self.taken += 1
        return value


def sequence(*values: Any) -> Sequence:
    """Successive calls return (or fail with) `values` in turn; the last one repeats."""
    if not values:
        raise ValueError("sequence() needs at least one value")
    return Sequence(values)


def _outcome(value: Any, call: ToolCall) -> Outcome:
    if isinstance(value, Sequence):
        return _outcome(value.next_value(), call)
    if callable(value) and not isinstance(value, Failure):
        return _outcome(value(call), call)
    if isinstance(value, Failure):
        return value.outcome()
    if isinstance(value, Outcome):
        return value
    return Outcome.ok(value)


@dataclass
class ToolMocks:
    """The mocks of one run (see the module doc) and the calls they answered."""

    by_key: Mapping[str, Any] = field(default_factory=dict)
    calls: dict[str, list[dict[str, Any]]] = field(default_factory=lambda: defaultdict(list))
    _step: threading.local = field(default_factory=threading.local)

    def mock_for(self, step: str | None, kind: str) -> tuple[bool, Any]:
        for key in (step, f"{KIND_PREFIX}{kind}"):
            if key is not None and key in self.by_key:
                return True, self.by_key[key]
        return False, None

    @contextlib.contextmanager
    def stepping(self, step: str) -> Iterator[None]:
        """While a dispatch of `step` runs: its tool calls go through the mocks."""
        if not self.by_key:
            yield
            return
        real = worker.run_tool
        self._step.name = step
        worker.run_tool = self._run_tool(real)  # type: ignore[assignment]
        try:
            yield
        finally:
            worker.run_tool = real  # type: ignore[assignment]
            self._step.name = None

    def _run_tool(self, real: Callable[[ToolCall], Outcome]) -> Callable[[ToolCall], Outcome]:
        def run(call: ToolCall) -> Outcome:
            step = getattr(self._step, "name", None)
            found, value = self.mock_for(step, call.kind)
            if not found:
                return real(call)
            self.calls[step or call.kind].append(dict(call.config))
            return _outcome(value, call)

        return run
