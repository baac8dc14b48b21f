"""Resolve the credentials a task names in `auth:`, and scrub their secrets from outputs.

`resolve(ref)`: ref is None, a name (`auth: pg_local`), or a mapping naming one
(`auth: {type: postgres, credential: pg_k8s}`; also `name:` or `key:`). Lookup order:
1. the env var NOETL_AUTH_<NAME> (the name upper-cased, every non-alphanumeric character -> _):
   a JSON object, or a plain string (a DSN, URL or token);
2. the JSON (.json) or YAML (any other suffix) file named by NOETL_CREDENTIALS_FILE: a mapping
   name -> credential (optionally nested under a top-level `credentials:` key).
A mapping ref with a `type` adds that type to a found mapping credential that has none.
A mapping ref without `credential:` that carries a credential inline (token/password/value/
headers/dsn/url...) is returned as it is. Not found -> CredentialError naming the credential and both
places looked.

`secret_values(credential)` lists the secret strings of a credential; `scrub(obj, secrets)`
replaces them (in every form, see secret_registry.forms) by "***" in a deep copy of a JSON-like
value. The engine masks through noetl_celery.config.secret_registry, which knows every configured value.

This module never logs and never puts a secret value into an error message.
"""

from __future__ import annotations

import json
import re
from functools import lru_cache
from typing import Any

from noetl_celery.config import secret_registry
from noetl_celery.config import settings as noetl_settings
from noetl_celery.config.secret_values import (  # re-exported: credentials.secret_values is the public name
    DSN_KEYS,
    SECRET_KEYS,
    _file_cache,
    _load_file,
)
from noetl_celery.config.secret_values import load_file_entries as load_file_entries
from noetl_celery.config.secret_values import secret_values as secret_values
from noetl_celery.core.errors import CredentialError

ENV_PREFIX = noetl_settings.AUTH_PREFIX
FILE_ENV = noetl_settings.CREDENTIALS_FILE_ENV
MIN_SECRET_LENGTH = 4  # shorter strings are not scrubbed (they would mangle ordinary text)
_NAME_KEYS = ("credential", "name", "key")


def forget_cached_files() -> None:
    """Drop the cached credential files (a forked worker process reads its own)."""
    _file_cache.clear()


def env_var_name(name: str) -> str:
    """The env var that holds credential `name`: NOETL_AUTH_<NAME, non-alnum -> _>."""
    return ENV_PREFIX + re.sub(r"[^A-Za-z0-9]", "_", name).upper()


# NoETL's auth `provider`/`source` values that name a cloud secret manager: not reachable here
SECRET_MANAGER_PROVIDERS = frozenset(
    {
        "secret_manager",
        "secretmanager",
        "google_secret_manager",
        "gcp",
        "google",
        "aws",
        "aws_secrets_manager",
        "azure",
        "azure_key_vault",
        "vault",
        "hashicorp_vault",
    }
)


def secret_manager_refusal(ref: Any) -> str | None:
    """Why `ref` cannot be resolved when it (or one of its aliases, NoETL's `{alias: {provider:
    secret_manager, key: ...}}`) asks a cloud secret manager; None otherwise."""
    items: list[tuple[str | None, Any]] = [(None, ref)]
    if isinstance(ref, dict):
        items += [(str(alias), value) for alias, value in ref.items() if isinstance(value, dict)]
    for alias, item in items:
        if not isinstance(item, dict):
            continue
        for key in ("provider", "source"):
            value = item.get(key)
            if isinstance(value, str) and value.lower() in SECRET_MANAGER_PROVIDERS:
                where = f"auth alias '{alias}'" if alias else "auth"
                return (
                    f"{where}: {key} '{value}' is a cloud secret manager, which this engine cannot read; "
                    f"give the credential as {ENV_PREFIX}<NAME> or in {FILE_ENV} and name it "
                    "with `credential: <name>`"
                )
    return None


def resolve(ref: Any) -> Any | None:
    """The credential `ref` names (a mapping or a string), None for no ref."""
    if ref is None or ref == "":
        return None
    refused = secret_manager_refusal(ref)
    if refused is not None:
        raise CredentialError(refused)
    cred_type: str | None = None
    if isinstance(ref, dict):
        cred_type = ref.get("type")
        names = [ref[k] for k in _NAME_KEYS if isinstance(ref.get(k), str) and ref[k]]
        if not ref.get("credential") and (SECRET_KEYS | DSN_KEYS | {"headers"}) & set(ref):
            return dict(ref)  # an inline credential ({type: header, name: X-Key, value: ...})
        name = names[0] if names else None
        if name is None:
            keys = ", ".join(sorted(str(k) for k in ref)) or "(none)"
            raise CredentialError(f"auth mapping names no credential: give `credential: <name>` (keys: {keys})")
    elif isinstance(ref, str):
        name = ref
    else:
        raise CredentialError(f"auth must be a credential name or a mapping, not {type(ref).__name__}")

    found = _from_env(name)
    if found is None:
        found = _from_file(name)
    if found is None:
        var = env_var_name(name)
        path = noetl_settings.load().credentials_file
        where_file = f"the file {path} ({FILE_ENV})" if path else f"no credentials file ({FILE_ENV} is not set)"
        raise CredentialError(f"credential {name!r} not found: looked in the env var {var} and in {where_file}")
    if cred_type and isinstance(found, dict) and "type" not in found:
        found = {"type": cred_type, **found}
    return found


def _from_env(name: str) -> Any | None:
    var = env_var_name(name)
    raw = noetl_settings.load().auth.get(var)
    if raw is None or not raw.strip():
        return None
    text = raw.strip()
    if text.startswith("{"):
        try:
            value = json.loads(text)
        except json.JSONDecodeError as exc:
            raise CredentialError(f"env var {var} starts with '{{' but is not valid JSON (at char {exc.pos})") from None
        if not isinstance(value, dict):
            raise CredentialError(f"env var {var} must hold a JSON object or a plain string")
        return value
    return text


def _from_file(name: str) -> Any | None:
    path = noetl_settings.load().credentials_file
    if not path:
        return None
    entries = _load_file(path)
    return entries.get(name)


def scrub(obj: Any, secrets: set[str] | frozenset[str] | list[str]) -> Any:
    """A deep copy of a JSON-like value with each secret (len >= 4), in every form
    secret_registry masks, replaced by "***"."""
    pattern = _masks_for(frozenset(s for s in secrets if isinstance(s, str)))
    return obj if pattern is None else _scrub(obj, pattern)


@lru_cache(maxsize=64)
def _masks_for(secrets: frozenset[str]) -> re.Pattern[str] | None:
    return secret_registry.compile_masks(secrets)


def _scrub(obj: Any, pattern: re.Pattern[str]) -> Any:
    if isinstance(obj, str):
        return pattern.sub("***", obj)
    if isinstance(obj, dict):
        return {_scrub(k, pattern) if isinstance(k, str) else k: _scrub(v, pattern) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_scrub(v, pattern) for v in obj]
    if isinstance(obj, tuple):
        return tuple(_scrub(v, pattern) for v in obj)
    if isinstance(obj, (set, frozenset)):
        return type(obj)(_scrub(v, pattern) for v in obj)
    return obj
