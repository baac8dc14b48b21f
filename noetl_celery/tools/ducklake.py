"""The `ducklake` tool: SQL on a DuckLake lakehouse (DuckDB's ducklake extension), whose catalog
lives in PostgreSQL, SQLite or a DuckDB file and whose data files live under `data_path`.

Config (rendered), NoETL's forms: `catalog_connection` (a PostgreSQL URL `postgresql://...`,
`sqlite:<file>`, a DuckDB catalog file path, or a full `ducklake:...` attach string) or `auth:` (a
PostgreSQL credential, the catalog's database); `catalog_name` (the alias the catalog is attached
as, a plain name); `data_path` (where the Parquet data files go; relative paths are under
NOETL_DUCKDB_DIR/ducklake; may be left out once the catalog exists: the catalog remembers it);
`command` (one text, several statements allowed) and/or `commands` (a list, run in order);
`use_catalog` (default true: `USE <catalog_name>`, so table names need no prefix);
`memory_limit`, `threads` (DuckDB settings); `create_catalog` is accepted and has no effect (the
extension creates a missing catalog on attach, as NoETL's does).

Each call opens an in-memory DuckDB connection, attaches the catalog, runs the commands and
detaches: several workers share one lakehouse through its catalog. Time travel is plain SQL
(`SELECT ... FROM t AT (VERSION => 3)`).

Data: `commands` (one entry per command: `{command_index, rows, row_count, columns}` for a
command that returns rows, `{command_index, affected_rows, status: "executed"}` otherwise),
`command_count`, NoETL's flat `rows`/`row_count`/`columns` of the last command that returned rows,
and `catalog` (`catalog_name`, `snapshot_id`: the catalog's latest snapshot after the call). A
failing command fails the attempt (kind "sql_error") and stops the call; NoETL's Python runtime
logged it and went on, its Rust runtime (today's NoETL) fails the step as this tool does. The
catalog's password never appears in the outcome.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from noetl_celery.config import settings as noetl_settings
from noetl_celery.core.jsonable import to_jsonable
from noetl_celery.core.vocabulary import ToolErrorKind
from noetl_celery.tools.base import SECRET_VALUES_META, Outcome, ToolCall, register
from noetl_celery.tools.duckdb import AttachError, load_extension, postgres_credential, quote
from noetl_celery.tools.settings import ToolSettings

DATA_DIR = "ducklake"  # under NOETL_DUCKDB_DIR: where a relative data_path goes
_POSTGRES_PREFIXES = ("postgresql://", "postgres://")
# a command that returns rows (a write's `Count` row aside); leading comments and parentheses skipped
_QUERY = re.compile(
    r"^(?:\s|--[^\n]*\n|/\*.*?\*/|\()*(?:SELECT|FROM|WITH|VALUES|SHOW|DESCRIBE|PRAGMA|SUMMARIZE|TABLE|EXPLAIN)\b",
    re.I | re.S,
)
_EXTENSIONS = {"postgres": ("postgres", "postgres_scanner"), "sqlite": ("sqlite", "sqlite_scanner")}


class DucklakeSettings(ToolSettings):
    catalog_connection: str | None = None
    catalog_name: str
    data_path: str | None = None
    command: str | None = None
    commands: list[str] | str | None = None
    use_catalog: bool = True
    create_catalog: bool = True
    memory_limit: str | None = None
    threads: int | None = None
    auth: str | dict[str, Any] | None = None


def catalog_target(connection: str | None, auth: Any, secrets: set[str]) -> tuple[str, str | None]:
    """The `ducklake:...` string to attach, and the extension its catalog needs (postgres, sqlite
    or None for a DuckDB file). The catalog database's password goes to `secrets`."""
    if connection:
        if connection.startswith("ducklake:"):
            kind = connection.split(":", 2)[1]
            return connection, kind if kind in _EXTENSIONS else None
        if connection.startswith(_POSTGRES_PREFIXES):
            return f"ducklake:postgres:{connection}", "postgres"
        if connection.startswith("sqlite:"):
            return f"ducklake:{connection}", "sqlite"
        return f"ducklake:{connection}", None
    if auth:
        params = postgres_credential("auth", auth, secrets)
        return f"ducklake:postgres:{params['dsn']}", "postgres"
    raise AttachError("give catalog_connection (a PostgreSQL URL, sqlite:<file> or a file) or auth")


def data_path(path: str | None) -> str | None:
    if not path:
        return None
    resolved = Path(path).expanduser()
    if not resolved.is_absolute() and "://" not in path:
        resolved = noetl_settings.load().duckdb_dir / DATA_DIR / resolved
        resolved.mkdir(parents=True, exist_ok=True)
    return str(resolved) if "://" not in path else path


def _commands(cfg: dict[str, Any]) -> list[str]:
    listed = cfg.get("commands")
    texts = [cfg["command"]] if isinstance(cfg.get("command"), str) else []
    texts += [listed] if isinstance(listed, str) else [str(c) for c in listed or ()]
    return [text for text in texts if text.strip()]


@register(
    "ducklake",
    fields={
        "catalog_connection",
        "catalog_name",
        "data_path",
        "command",
        "commands",
        "use_catalog",
        "create_catalog",
        "memory_limit",
        "threads",
    },
    required=({"catalog_name"}, {"command", "commands"}),
    settings=DucklakeSettings,
    resolves_auth=True,
    extra="ducklake",
    modules=("duckdb",),
)
def run_ducklake(call: ToolCall) -> Outcome:
    """Attach the catalog, run the commands in order, detach."""
    import duckdb  # imported here: a worker without duckdb still runs every other tool

    cfg = call.config
    name = cfg.get("catalog_name")
    if not isinstance(name, str) or not name.isidentifier():
        return Outcome.fail(ToolErrorKind.INVALID_ARGS, f"ducklake: catalog_name must be a plain name, not {name!r}")
    commands = _commands(cfg)
    if not commands:
        return Outcome.fail(ToolErrorKind.INVALID_ARGS, "ducklake: give `command` or `commands`")
    secrets: set[str] = set()
    try:
        outcome = _run(duckdb, cfg, name, commands, secrets)
    except AttachError as exc:
        kind = ToolErrorKind.EXTENSION if "extension" in str(exc) else "credential"
        outcome = Outcome.fail(kind, f"ducklake: {exc}")
    if secrets:
        outcome.meta[SECRET_VALUES_META] = sorted(secrets)
    return outcome


def _attach(duckdb: Any, conn: Any, cfg: dict[str, Any], name: str, secrets: set[str]) -> None:
    target, catalog_extension = catalog_target(cfg.get("catalog_connection"), cfg.get("auth"), secrets)
    load_extension(conn, duckdb, "ducklake")
    if catalog_extension is not None:
        load_extension(conn, duckdb, *_EXTENSIONS[catalog_extension])
    if cfg.get("memory_limit"):
        conn.execute(f"SET memory_limit={quote(str(cfg['memory_limit']))}")
    if cfg.get("threads"):
        conn.execute(f"SET threads={int(cfg['threads'])}")
    path = data_path(cfg.get("data_path"))
    options = f" (DATA_PATH {quote(path)})" if path else ""
    conn.execute(f"ATTACH {quote(target)} AS {name}{options}")
    if cfg.get("use_catalog", True):
        conn.execute(f"USE {name}")


def _run(duckdb: Any, cfg: dict[str, Any], name: str, commands: list[str], secrets: set[str]) -> Outcome:
    conn = duckdb.connect(":memory:")
    try:
        try:
            _attach(duckdb, conn, cfg, name, secrets)
        except duckdb.Error as exc:  # only an unreachable catalog is worth a retry, not a wrong setting
            transient = isinstance(exc, (duckdb.IOException, duckdb.ConnectionException))
            return Outcome.fail(ToolErrorKind.CONNECTION, f"ducklake: cannot attach catalog {name}: {exc}", transient)
        results: list[dict[str, Any]] = []
        for index, text in enumerate(commands):
            try:
                cursor = conn.execute(text)
                results.append(_command_result(index, text, cursor))
            except duckdb.Error as exc:
                return Outcome.fail(
                    ToolErrorKind.SQL_ERROR,
                    f"ducklake: command {index + 1} of {len(commands)}: {type(exc).__name__}: {exc}",
                    data={"commands": results, "command_count": len(results)},
                )
        snapshot = conn.execute(f"SELECT max(snapshot_id) FROM ducklake_snapshots({quote(name)})").fetchone()
        last = next((r for r in reversed(results) if "rows" in r), {"rows": [], "row_count": 0, "columns": []})
        return Outcome.ok(
            {
                "commands": results,
                "command_count": len(results),
                "rows": last["rows"],
                "row_count": last["row_count"],
                "columns": last["columns"],
                "catalog": {"catalog_name": name, "snapshot_id": snapshot[0] if snapshot else None},
            }
        )
    finally:
        conn.close()


def _command_result(index: int, text: str, cursor: Any) -> dict[str, Any]:
    """A query's rows; a statement's count of affected rows (DuckDB answers a write with one
    `Count` row; DDL with none)."""
    columns = [d[0] for d in cursor.description] if cursor.description else []
    if not _QUERY.match(text) and columns in ([], ["Count"]):
        counted = cursor.fetchall() if columns else []
        affected = sum(int(row[0] or 0) for row in counted)
        return {"command_index": index, "affected_rows": affected, "status": "executed"}
    rows = [to_jsonable(dict(zip(columns, row, strict=True))) for row in cursor.fetchall()]
    return {"command_index": index, "rows": rows, "row_count": len(rows), "columns": columns}
