"""Checks of the broker: its configuration, before connecting (the CLI's, a worker's), and whether
it accepts a connection (the server's readiness)."""

from __future__ import annotations

from noetl_celery.core.errors import ConfigurationError
from noetl_celery.store.check import one_line, safe_url


def check_broker_url(url: str) -> None:
    """Refuse a broker URL that does not parse (a password with '#', '/' or '@' not percent-encoded)."""
    from kombu.utils.url import parse_url  # on use: `noetl-celery validate` loads no kombu

    try:
        parse_url(url)
    except ValueError as exc:
        raise ConfigurationError(
            f"NOETL_BROKER_URL {safe_url(url)} is not a valid URL ({one_line(exc)}); percent-encode "
            "special characters of the user and password (# -> %23, / -> %2F, @ -> %40)"
        ) from None


def connect_once(url: str, timeout: float) -> None:
    """Open and close one connection to the broker at `url`, within `timeout` seconds; raises
    whatever kombu raises when it cannot."""
    from kombu import Connection  # on use, as above

    with Connection(url, connect_timeout=timeout) as conn:
        conn.ensure_connection(max_retries=1, interval_start=0, timeout=timeout)
