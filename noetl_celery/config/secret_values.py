"""What in a credential is secret, and the credentials file: the ground floor of configuration.

`secret_values(credential)` lists the secret strings of a credential (tokens, passwords, header
values, the password inside a DSN or URL, basic-auth pairs); `load_file_entries(path)` reads the
credentials file (NOETL_CREDENTIALS_FILE) as name -> credential. The secret registry
(secret_registry.py) masks what these return; credentials.py resolves `auth:` references over
them. Neither settings nor the registry is imported here, so configuration has no circle:
secret_values <- secret_registry <- settings <- credentials.

This module never logs and never puts a secret value into an error message.
"""

from __future__ import annotations

import base64
import json
import re
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlsplit

import yaml

from noetl_celery.core.errors import CredentialError

SECRET_KEYS = frozenset(
    {
        "password",
        "passwd",
        "pass",
        "token",
        "access_token",
        "refresh_token",
        "id_token",
        "secret",
        "client_secret",
        "api_key",
        "apikey",
        "value",
        "private_key",
        "authorization",
        "nats_password",
        "nats_token",
        "aws_access_key_id",  # S3 (tools/object_store.py reads these spellings); the key id too
        "access_key_id",
        "aws_secret_access_key",
        "secret_access_key",
        "secret_key",
        "aws_session_token",
        "session_token",
        "service_account_json",  # GCS: the whole key file, when given as JSON text
    }
)
# keys whose value is a URL (or a list of URLs: NATS `servers`) that may carry a password
DSN_KEYS = frozenset({"dsn", "url", "uri", "connection_string", "database_url", "nats_url", "server", "servers"})
_TOKEN_URL_SCHEMES = frozenset({"nats", "tls", "ws", "wss"})  # schemes whose user-info alone is a token

_file_cache: dict[str, tuple[float, dict[str, Any]]] = {}


def load_file_entries(path: str) -> dict[str, Any]:
    """Every name -> credential of the credentials file at `path`."""
    return _load_file(Path(path))


def _load_file(path: Path) -> dict[str, Any]:
    """The name -> credential mapping of a credentials file (cached by modification time)."""
    try:
        mtime = path.stat().st_mtime
    except OSError:
        raise CredentialError(f"credentials file {path} (NOETL_CREDENTIALS_FILE) cannot be read") from None
    cached = _file_cache.get(str(path))
    if cached is not None and cached[0] == mtime:
        return cached[1]
    try:
        text = path.read_text(encoding="utf-8")
        if path.suffix.lower() == ".json":
            data = json.loads(text)
        else:
            data = yaml.safe_load(text)
    except OSError:
        raise CredentialError(f"credentials file {path} (NOETL_CREDENTIALS_FILE) cannot be read") from None
    except json.JSONDecodeError as exc:  # messages of the parsers could quote secrets: keep the position only
        raise CredentialError(f"credentials file {path} is not valid JSON (line {exc.lineno})") from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" (line {mark.line + 1})" if mark is not None else ""
        raise CredentialError(f"credentials file {path} is not valid YAML{where}") from None
    if data is None:
        data = {}
    if isinstance(data, dict) and set(data) == {"credentials"} and isinstance(data["credentials"], dict):
        data = data["credentials"]
    if not isinstance(data, dict):
        raise CredentialError(f"credentials file {path} must hold a mapping name -> credential")
    _file_cache[str(path)] = (mtime, data)
    return data


def _url_password(text: str) -> set[str]:
    """The password of scheme://user:password@host/..., whatever characters it holds.

    urlsplit stops the authority at '#', '?' or '/', so a password holding one of them is misread
    (and libpq then quotes the rest as a host name). Here the user-info runs up to the last '@'
    before the host, and every plausible reading is kept (raw and percent-decoded).
    """
    rest = text.split("://", 1)[1]
    found: set[str] = set()
    try:
        password = urlsplit(text).password
    except ValueError:
        password = None
    if password:
        found |= {password, unquote(password)}
    for at in (i for i, char in enumerate(rest) if char == "@"):
        userinfo = rest[:at]
        if ":" in userinfo:
            candidate = userinfo.split(":", 1)[1]
            if candidate:
                found |= {candidate, unquote(candidate)}
        elif userinfo and text.split("://", 1)[0].lower() in _TOKEN_URL_SCHEMES:
            found |= {userinfo, unquote(userinfo)}  # nats://TOKEN@host: the user-info is a token
    return found


def _dsn_passwords(text: str) -> set[str]:
    """The password inside a URL (scheme://user:password@host, raw and decoded) or a key=value DSN."""
    if "://" in text:
        return _url_password(text)
    match = re.search(r"(?:^|\s)password\s*=\s*('(?:[^'\\]|\\.)*'|\S+)", text)
    if not match:
        return set()
    value = match.group(1)
    if value.startswith("'"):
        value = re.sub(r"\\(.)", r"\1", value[1:-1])
    return {value}


def _looks_like_dsn(text: str) -> bool:
    return "://" in text or bool(re.search(r"(?:^|\s)(host|dbname|user|password)\s*=", text))


def secret_values(credential: Any) -> set[str]:
    """The secret strings inside a credential, to be scrubbed from outcomes and logs.

    A plain string is a secret as a whole, unless it is a DSN/URL (then its password is).
    In a mapping: the values of password/token/value/secret/api_key-like keys, every value
    under `headers`, the password of dsn/url values, and the basic-auth header value.
    """
    found: set[str] = set()
    if credential is None:
        return found
    if isinstance(credential, str):
        if _looks_like_dsn(credential):
            found |= _dsn_passwords(credential)
        elif credential:
            found.add(credential)
        return found
    if isinstance(credential, list):
        for item in credential:
            found |= secret_values(item) if isinstance(item, (dict, list)) else set()
        return found
    if not isinstance(credential, dict):
        return found
    for key, value in credential.items():
        lowered = str(key).lower()
        if isinstance(value, (dict, list)):
            if lowered in DSN_KEYS and isinstance(value, list):
                for url in value:
                    found |= _dsn_passwords(url) if isinstance(url, str) else set()
            elif lowered == "headers" and isinstance(value, dict):
                found |= {str(v) for v in value.values() if v not in (None, "")}
            else:
                found |= secret_values(value)
        elif value is None or value == "":
            continue
        elif lowered in SECRET_KEYS:
            found.add(str(value))
        elif lowered in DSN_KEYS and isinstance(value, str):
            found |= _dsn_passwords(value)
    if credential.get("password") and (credential.get("username") or credential.get("user")):
        user = credential.get("username") or credential.get("user")
        found.add(base64.b64encode(f"{user}:{credential['password']}".encode()).decode("ascii"))
    return found
