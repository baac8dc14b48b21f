"""What a `transfer` call asks for, read from its rendered config: the two endpoints, the mode,
the chunk size, the upsert key and the column mapping, each checked with an error naming the
field (`source.type`, `target.table`, ...). Decides nothing about how rows move.

NoETL's shapes: `source: {type|kind|tool, auth, query | url | path, ...}`,
`target: {type, auth, table | query | url | path, mapping, ...}`, `mode: append | insert |
replace | upsert`, `chunk_size` (default 1000). `key` (on the task or the target; a column or a
list) names the upsert key; without it the first target column is the key, as NoETL does.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

DEFAULT_CHUNK_SIZE = 1000  # rows per chunk, NoETL's default
MAX_CHUNK_SIZE = 100_000  # rows held in memory at once, at most

SQL_TYPES = frozenset({"postgres", "mysql", "duckdb", "sqlite", "snowflake"})
FILE_TYPES = frozenset({"file", "csv", "jsonl", "parquet", "s3", "gcs"})
HTTP_TYPES = frozenset({"http"})
TYPE_ALIASES = {
    "postgresql": "postgres",
    "pg": "postgres",
    "mariadb": "mysql",
    "sqlite3": "sqlite",
    "ndjson": "jsonl",
    "json": "jsonl",
    "gs": "gcs",
}
ENDPOINT_TYPES = SQL_TYPES | FILE_TYPES | HTTP_TYPES
MODES = ("append", "insert", "replace", "upsert")
MODE_ALIASES = {"merge": "upsert"}


class PlanError(ValueError):
    """The task's transfer settings cannot be used (the message names the field)."""


@dataclass
class Endpoint:
    """One side of the copy: its type and its own settings (`auth` still unresolved)."""

    side: str  # "source" or "target"
    type: str
    settings: dict[str, Any]

    def get(self, *names: str) -> Any:
        """The first of `names` the endpoint sets (aliases of one setting)."""
        return next((self.settings[n] for n in names if self.settings.get(n) not in (None, "")), None)

    def text(self, *names: str) -> str | None:
        value = self.get(*names)
        if value is None:
            return None
        if not isinstance(value, str):
            raise PlanError(f"{self.side}.{names[0]} must be a string, not {type(value).__name__}")
        return value


@dataclass
class TransferPlan:
    source: Endpoint
    target: Endpoint
    mode: str = "append"
    chunk_size: int = DEFAULT_CHUNK_SIZE
    key: list[str] = field(default_factory=list)
    mapping: dict[str, str] | None = None

    @property
    def direction(self) -> str:
        return f"{self.source.type}_to_{self.target.type}"


def read_plan(config: dict[str, Any]) -> TransferPlan:
    """The plan of a rendered `transfer` config, or PlanError."""
    source = read_endpoint("source", config.get("source"))
    target = read_endpoint("target", config.get("target"))
    mode = read_mode(config.get("mode") or target.get("mode") or "append")
    plan = TransferPlan(
        source=source,
        target=target,
        mode=mode,
        chunk_size=_chunk_size(_first(config.get("chunk_size"), config.get("batch_size"), source.get("chunk_size"))),
        key=_columns("key", config.get("key") or target.get("key", "upsert_key", "conflict_key")),
        mapping=_mapping(target.get("mapping") or config.get("mapping")),
    )
    _check_target(plan)
    return plan


def _first(*values: Any) -> Any:
    return next((v for v in values if v is not None), None)


def read_endpoint(side: str, value: Any, require_fields: bool = True) -> Endpoint:
    """The endpoint `value` describes; require_fields: its query/url/path must be there too."""
    if not isinstance(value, dict) or not value:
        raise PlanError(f"`{side}` must be a mapping with a `type` (one of {', '.join(sorted(ENDPOINT_TYPES))})")
    raw = value.get("type") or value.get("kind") or value.get("tool")
    if not isinstance(raw, str) or not raw:
        raise PlanError(f"{side}.type is required: one of {', '.join(sorted(ENDPOINT_TYPES))}")
    kind = TYPE_ALIASES.get(raw.lower(), raw.lower())
    if kind not in ENDPOINT_TYPES:
        raise PlanError(f"{side}.type {raw!r} is not an endpoint this tool has: {', '.join(sorted(ENDPOINT_TYPES))}")
    endpoint = Endpoint(side, kind, dict(value))
    if not require_fields:
        return endpoint
    if kind in SQL_TYPES and side == "source" and not endpoint.get("query", "sql", "command", "table"):
        raise PlanError(f"source.query is required for a {kind} source (or source.table to copy a whole table)")
    if kind in HTTP_TYPES and not endpoint.get("url", "endpoint"):
        raise PlanError(f"{side}.url is required for an http {side}")
    if kind in FILE_TYPES and not endpoint.get("path", "url", "uri", "file"):
        raise PlanError(f"{side}.path is required for a {kind} {side} (a local path, s3:// or gs:// URL)")
    return endpoint


def read_mode(value: Any) -> str:
    text = str(value).lower()
    text = MODE_ALIASES.get(text, text)
    if text not in MODES:
        raise PlanError(f"mode must be one of {', '.join(MODES)}, not {value!r}")
    return text


def _chunk_size(value: Any) -> int:
    if value is None:
        return DEFAULT_CHUNK_SIZE
    try:
        size = int(value)
    except (TypeError, ValueError):
        raise PlanError(f"chunk_size must be a whole number of rows, not {value!r}") from None
    if not 1 <= size <= MAX_CHUNK_SIZE:
        raise PlanError(f"chunk_size must be between 1 and {MAX_CHUNK_SIZE}, not {size}")
    return size


def _columns(name: str, value: Any) -> list[str]:
    if value is None:
        return []
    if isinstance(value, str):
        return [part.strip() for part in value.split(",") if part.strip()]
    if isinstance(value, list) and all(isinstance(v, str) and v for v in value):
        return list(value)
    raise PlanError(f"{name} must be a column name or a list of them, not {value!r}")


def _mapping(value: Any) -> dict[str, str] | None:
    if value is None:
        return None
    if not isinstance(value, dict) or not value or not all(isinstance(v, str) and v for v in value.values()):
        raise PlanError("target.mapping must be a mapping {target_column: source_field} of strings")
    return {str(k): v for k, v in value.items()}


def _check_target(plan: TransferPlan) -> None:
    target = plan.target
    if target.type in SQL_TYPES and not target.get("table", "query"):
        raise PlanError(f"target.table (or target.query, an INSERT with placeholders) is required for {target.type}")
    if plan.mode == "upsert" and target.type not in SQL_TYPES:
        raise PlanError(f"mode upsert needs a database target; a {target.type} target is written whole")
    custom_only = target.get("query") and not target.get("table")
    if plan.mode in ("upsert", "replace") and target.type in SQL_TYPES and custom_only:
        raise PlanError(f"mode {plan.mode} needs target.table (a custom target.query writes rows as it says)")
