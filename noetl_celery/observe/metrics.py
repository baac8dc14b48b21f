"""What a worker counts itself, for Prometheus, and the port it shows them on.

Decides: the worker-side series (attempts by outcome and tool kind, tool duration, decision
latency, re-publishes, webhook delivery attempts) and how a prefork worker exposes them. What
the store knows (executions by status and playbook, overdue leases, the sweeper's lag, queue
depths, webhook and schedule states) is read by the server's `/metrics` instead (collector.py):
one truth for the whole deployment, whichever worker is up.

Recording is off (each call a no-op: one global read) unless NOETL_METRICS_PORT is set; then
the worker's main process calls `start_worker_endpoint` before it forks its pool (Celery's
`worker_init`), which puts prometheus_client in multiprocess mode: every pool process writes its
values to files of its own in a fresh temporary directory (removed at the worker's exit), and the
main process's HTTP endpoint sums them on each scrape. So a pool process that is replaced
(max-tasks-per-child, a crash) keeps its counts; only counters and histograms are recorded here
(no gauge: a gauge of a dead process would linger). Recording costs about a microsecond or two
per call with it on (docs/operations.md, "Metrics", has the figures).
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
from dataclasses import dataclass
from typing import Any

log = logging.getLogger(__name__)

MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"
DECISION_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)  # seconds
TOOL_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0, 1800.0)  # seconds


@dataclass(frozen=True)
class _Instruments:
    attempts: Any
    tool_seconds: Any
    decision_seconds: Any
    republished: Any
    webhook_attempts: Any


_on: _Instruments | None = None  # None: recording is off
_attempt_children: dict[tuple[str, str], tuple[Any, Any]] = {}  # (tool, outcome) -> its counter and histogram


def _instruments() -> _Instruments:
    from prometheus_client import Counter, Histogram

    return _Instruments(
        attempts=Counter(
            "noetl_attempts", "Attempts that ended, by outcome and tool kind", ["outcome", "tool"], registry=None
        ),
        tool_seconds=Histogram(
            "noetl_tool_duration_seconds",
            "Seconds one attempt's tool call took",
            ["tool"],
            buckets=TOOL_BUCKETS,
            registry=None,
        ),
        decision_seconds=Histogram(
            "noetl_decision_seconds",
            "Seconds one on_event decision took (recorded, not published)",
            buckets=DECISION_BUCKETS,
            registry=None,
        ),
        republished=Counter(
            "noetl_republished_attempts", "Overdue attempts the sweeper published again", registry=None
        ),
        webhook_attempts=Counter(
            "noetl_webhook_delivery_attempts", "Webhook delivery attempts, by outcome", ["outcome"], registry=None
        ),
    )


def enabled() -> bool:
    return _on is not None


def enable(directory: str) -> None:
    """Record into `directory` (multiprocess mode) from now on, in this process and its forks."""
    global _on
    os.environ[MULTIPROC_ENV] = directory
    from prometheus_client import values

    values.ValueClass = values.MultiProcessValue()  # in case prometheus_client was imported before
    _attempt_children.clear()
    _on = _instruments()


def disable() -> None:
    global _on
    _on = None
    _attempt_children.clear()


def attempt_ended(tool: str, outcome: str, seconds: float) -> None:
    """One attempt's outcome (`ok`, `error`, ...) and its duration."""
    if _on is None:
        return
    children = _attempt_children.get((tool, outcome))
    if children is None:  # labels() takes a lock and builds a key: once per pair
        children = _attempt_children[(tool, outcome)] = (
            _on.attempts.labels(outcome, tool),
            _on.tool_seconds.labels(tool),
        )
    children[0].inc()
    children[1].observe(seconds)


def decision_took(seconds: float) -> None:
    if _on is not None:
        _on.decision_seconds.observe(seconds)


def republished(count: int) -> None:
    if _on is not None and count:
        _on.republished.inc(count)


def webhook_delivery(outcome: str) -> None:
    """One delivery attempt: `delivered`, `retry` (failed, tried again), `gave_up` (failed, the last)."""
    if _on is not None:
        _on.webhook_attempts.labels(outcome).inc()


def worker_registry(directory: str) -> Any:
    """A registry that sums what every process wrote into `directory`."""
    from prometheus_client import CollectorRegistry
    from prometheus_client.multiprocess import MultiProcessCollector

    registry = CollectorRegistry()
    MultiProcessCollector(registry, path=directory)
    return registry


def start_worker_endpoint(port: int, host: str = "0.0.0.0", parent: str | None = None) -> str:
    """Turn recording on and serve the sum of this worker's processes on http://host:port/metrics.
    Called in the worker's main process before the pool forks. Returns the directory the values
    are written to (fresh: made under `parent`, removed at exit)."""
    import atexit

    from prometheus_client import start_http_server

    directory = tempfile.mkdtemp(prefix="noetl-metrics-", dir=parent)
    owner = os.getpid()

    def remove() -> None:  # by the worker that made it, never a forked child
        if os.getpid() == owner:
            shutil.rmtree(directory, True)

    atexit.register(remove)
    enable(directory)
    start_http_server(port, addr=host, registry=worker_registry(directory))
    log.info("metrics: this worker's series on http://%s:%d/metrics", host, port)
    return directory
