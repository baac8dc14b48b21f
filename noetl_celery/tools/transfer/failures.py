"""How a failure of one side of a transfer becomes the attempt's error: its kind, whether a
retry may help, and a message naming the side ("target (mysql): ...") with every secret of
both credentials replaced by ***. Decides nothing else."""

from __future__ import annotations

from noetl_celery.config import credentials
from noetl_celery.core.vocabulary import ToolErrorKind

RETRYABLE_SQLSTATES = frozenset({"40001", "40P01"})  # PostgreSQL: serialization failure, deadlock
MYSQL_CONNECTION_CODES = frozenset({2002, 2003, 2006, 2013})  # cannot connect, gone away, lost
MYSQL_RETRYABLE_CODES = frozenset({1205, 1213})  # lock wait timeout, deadlock
MYSQL_REFUSED_LOGIN = frozenset({1044, 1045, 1049})  # access denied, unknown database


class SideError(Exception):
    """A failure raised by the library of one side of the copy."""

    def __init__(self, side: str, kind: str, error: Exception) -> None:
        super().__init__(f"{side} ({kind}): {type(error).__name__}: {str(error).strip()}")
        self.side, self.kind, self.error = side, kind, error


def classify(exc: SideError, secrets: set[str]) -> tuple[str, bool, str]:
    """(error kind, retryable, message) of a side's failure."""
    message = str(credentials.scrub(str(exc), secrets))
    error = exc.error
    library = type(error).__module__.split(".")[0]
    name = type(error).__name__
    if library == "psycopg2":
        code = getattr(error, "pgcode", None)
        if code is None and name in ("OperationalError", "InterfaceError"):
            permanent = any(h in str(error) for h in ("authentication failed", "does not exist", "pg_hba.conf"))
            return ToolErrorKind.CONNECTION, not permanent, message
        return ToolErrorKind.SQL_ERROR, code in RETRYABLE_SQLSTATES, message
    if library == "pymysql":
        code = error.args[0] if error.args and isinstance(error.args[0], int) else None
        if code in MYSQL_CONNECTION_CODES:
            return ToolErrorKind.CONNECTION, True, message
        if code in MYSQL_REFUSED_LOGIN:
            return ToolErrorKind.CONNECTION, False, message
        return ToolErrorKind.SQL_ERROR, code in MYSQL_RETRYABLE_CODES, message
    if library == "snowflake":
        return _snowflake(error, name, message)
    if library in ("sqlite3", "_duckdb", "duckdb"):
        return ToolErrorKind.SQL_ERROR, "locked" in str(error).lower(), message
    if library == "noetl_celery" and name == "HttpError":
        status = getattr(error, "status", None)
        if status is None:
            return ToolErrorKind.CONNECTION, True, message
        if status >= 500 or status == 429:
            return ToolErrorKind.SERVER_ERROR, True, message
        return ToolErrorKind.CLIENT_ERROR, False, message
    if library == "noetl_celery" and name in ("ObjectStoreError", "ObjectNotFound", "ObjectTooLarge"):
        return str(getattr(error, "kind", ToolErrorKind.EXCEPTION)), bool(getattr(error, "retryable", False)), message
    if isinstance(error, OSError):
        return ToolErrorKind.CONNECTION, True, message
    return ToolErrorKind.EXCEPTION, False, message


def _snowflake(error: Exception, name: str, message: str) -> tuple[str, bool, str]:
    """A refused login is the credential's fault (authorization); a server not reached, or a
    lost connection, may pass (connection, retryable); anything else the SQL's (sql_error)."""
    from noetl_celery.tools.snowflake import AUTH_ERRNOS

    if getattr(error, "errno", None) in AUTH_ERRNOS:
        return ToolErrorKind.AUTHORIZATION, False, message
    if name in ("OperationalError", "InterfaceError"):
        return ToolErrorKind.CONNECTION, True, message
    return ToolErrorKind.SQL_ERROR, False, message
