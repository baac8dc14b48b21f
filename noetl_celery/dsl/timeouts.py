"""A task's time limits in each way NoETL writes them, read as one number of seconds.

Decides: that NoETL's Rust http tool field `timeout_seconds` is the task's `timeout`, and that a
task `spec.timeout: {connect, read}` mapping (NoETL's TaskSpec) bounds an attempt by connect +
read seconds, the http tool also waiting at most `connect` seconds for its connection
(`connect_timeout`). `write` and `pool` (httpx's other phases) are accepted and bound nothing
more. A templated value is left for the tool's kind default, as a templated `timeout:` is.
"""

from __future__ import annotations

from typing import Any

from noetl_celery.dsl.validate import Context, join
from noetl_celery.tools.base import ToolSpec

SECONDS_ALIAS = "timeout_seconds"  # NoETL's Rust http tool: the request's timeout in seconds
CONNECT_KEY = "connect_timeout"  # the http tool's connection bound, set from {connect: ...}
PHASES = ("connect", "read")  # summed: the attempt's bound
OTHER_PHASES = frozenset({"write", "pool"})  # accepted, bound nothing more


def normalise_timeouts(ctx: Context, spec: ToolSpec, config: dict[str, Any], line: int | None, path: str) -> None:
    """Rewrite `config` in place: `timeout_seconds` -> `timeout`, a `{connect, read}` mapping ->
    `timeout` (their sum) and, for a tool that has it, `connect_timeout`."""
    if SECONDS_ALIAS in config:
        if "timeout" in config:
            ctx.problem(line, join(path, SECONDS_ALIAS), "give the timeout once: timeout or timeout_seconds")
            config.pop(SECONDS_ALIAS)
        else:
            config["timeout"] = config.pop(SECONDS_ALIAS)
    phases = config.get("timeout")
    if not isinstance(phases, dict):
        return
    where = join(path, "timeout")
    unknown = sorted(set(phases) - set(PHASES) - OTHER_PHASES)
    if unknown:
        ctx.problem(
            line, where, f"a timeout mapping has connect and read (seconds), not {', '.join(map(str, unknown))}"
        )
    seconds = {name: _seconds(ctx, phases.get(name), line, join(where, name)) for name in PHASES if name in phases}
    if not seconds:
        ctx.problem(line, where, "a timeout mapping needs connect or read (seconds)")
    if any(value is None for value in seconds.values()) or not seconds:
        config.pop("timeout")
        return
    config["timeout"] = float(sum(value for value in seconds.values() if value is not None))
    if "connect" in seconds and CONNECT_KEY in spec.fields:
        config[CONNECT_KEY] = seconds["connect"]


def _seconds(ctx: Context, value: Any, line: int | None, path: str) -> float | None:
    if isinstance(value, str) and ("{{" in value or "{%" in value):
        return None  # templated: the kind's default bounds the attempt
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
        ctx.problem(line, path, f"must be a positive number of seconds, not {value!r}")
        return None
    return float(value)
