"""Credentials from env vars and JSON/YAML files, the not-found message, and scrubbing."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from noetl_celery.config import credentials
from noetl_celery.config.credentials import env_var_name, resolve, scrub, secret_values
from noetl_celery.core.errors import CredentialError


@pytest.fixture(autouse=True)
def clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    import os

    for var in list(os.environ):
        if var.startswith("NOETL_AUTH_") or var == "NOETL_CREDENTIALS_FILE":
            monkeypatch.delenv(var)


def test_env_var_name() -> None:
    assert env_var_name("pg_k8s") == "NOETL_AUTH_PG_K8S"
    assert env_var_name("my-api.key") == "NOETL_AUTH_MY_API_KEY"


def test_none_and_env_json_and_plain(monkeypatch: pytest.MonkeyPatch) -> None:
    assert resolve(None) is None
    monkeypatch.setenv("NOETL_AUTH_PG_LOCAL", "postgresql://postgres@127.0.0.1:5432/postgres")
    assert resolve("pg_local") == "postgresql://postgres@127.0.0.1:5432/postgres"
    monkeypatch.setenv("NOETL_AUTH_PG_K8S", json.dumps({"host": "db", "user": "u", "password": "pw"}))
    # the corpus form: auth: {type: postgres, credential: pg_k8s}; the type is added when missing
    assert resolve({"type": "postgres", "credential": "pg_k8s"}) == {
        "type": "postgres",
        "host": "db",
        "user": "u",
        "password": "pw",
    }
    assert resolve({"name": "pg_k8s"})["host"] == "db"


def test_env_bad_json_does_not_echo_value(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("NOETL_AUTH_BROKEN", '{"password": "hunter22"')
    with pytest.raises(CredentialError) as info:
        resolve("broken")
    assert "NOETL_AUTH_BROKEN" in str(info.value) and "hunter22" not in str(info.value)


def test_json_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "creds.json"
    path.write_text(json.dumps({"api": {"type": "bearer", "token": "tok-123"}, "pg_test": "host=db dbname=x"}))
    monkeypatch.setenv("NOETL_CREDENTIALS_FILE", str(path))
    assert resolve("api") == {"type": "bearer", "token": "tok-123"}
    assert resolve("pg_test") == "host=db dbname=x"
    monkeypatch.setenv("NOETL_AUTH_API", "from-env-wins")
    assert resolve("api") == "from-env-wins"


def test_yaml_file_and_reload(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "creds.yaml"
    path.write_text("credentials:\n  pg_local:\n    host: 127.0.0.1\n    user: postgres\n    database: postgres\n")
    monkeypatch.setenv("NOETL_CREDENTIALS_FILE", str(path))
    assert resolve("pg_local") == {"host": "127.0.0.1", "user": "postgres", "database": "postgres"}
    credentials._file_cache.clear()
    path.write_text("other: {token: abcd}\n")
    assert resolve("other") == {"token": "abcd"}


def test_not_found_names_credential_and_places(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(CredentialError) as info:
        resolve("pg_missing")
    message = str(info.value)
    assert "pg_missing" in message and "NOETL_AUTH_PG_MISSING" in message and "NOETL_CREDENTIALS_FILE" in message
    path = tmp_path / "c.yaml"
    path.write_text("present: {password: topsecret}\n")
    monkeypatch.setenv("NOETL_CREDENTIALS_FILE", str(path))
    with pytest.raises(CredentialError) as info:
        resolve({"type": "postgres", "credential": "pg_missing"})
    assert str(path) in str(info.value) and "topsecret" not in str(info.value)


def test_bad_yaml_file_does_not_echo_content(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "c.yaml"
    path.write_text("a: {password: 'sekrit99\n  b: [\n")
    monkeypatch.setenv("NOETL_CREDENTIALS_FILE", str(path))
    with pytest.raises(CredentialError) as info:
        resolve("a")
    assert "not valid YAML" in str(info.value) and "sekrit99" not in str(info.value)


def test_inline_mapping_and_bad_ref() -> None:
    inline = {"type": "header", "name": "X-Key", "value": "v-1234"}
    assert resolve(inline) == inline
    with pytest.raises(CredentialError):
        resolve({"type": "postgres"})


def test_secret_values() -> None:
    assert secret_values(None) == set()
    assert secret_values("plain-token-xyz") == {"plain-token-xyz"}
    assert secret_values("postgresql://u:p%40ssw0rd@h:5432/db") == {"p%40ssw0rd", "p@ssw0rd"}
    assert secret_values("host=h user=u password=pw-dsn dbname=d") == {"pw-dsn"}
    assert secret_values("postgresql://u@h/db") == set()
    found = secret_values({"type": "basic", "username": "user", "password": "pass-1"})
    assert "pass-1" in found and "dXNlcjpwYXNzLTE=" in found  # the basic-auth header value too
    assert secret_values({"type": "bearer", "token": "tok"}) == {"tok"}
    assert secret_values({"headers": {"X-Api": "hdr-val"}, "dsn": "postgres://a:b-pass@h/d"}) == {
        "hdr-val",
        "b-pass",
    }


def test_scrub_deep_copy() -> None:
    value = {"msg": "token tok-123 and pw-secret", "list": ["tok-123", 5, ("pw-secret",)], "k": None}
    out = scrub(value, {"tok-123", "pw-secret", "ab"})
    assert out == {"msg": "token *** and ***", "list": ["***", 5, ("***",)], "k": None}
    assert value["msg"] == "token tok-123 and pw-secret"  # the input is untouched
    assert scrub("ab abc", {"ab"}) == "ab abc"  # secrets shorter than 4 characters are not scrubbed


def _encodings(secret: str) -> dict[str, str]:
    """The spellings an encoder gives a secret (written independently of the engine)."""
    import base64
    import re
    from urllib.parse import quote

    def lower_hex(text: str) -> str:
        return re.sub(r"%[0-9A-F]{2}", lambda m: m.group(0).lower(), text)

    lower = lower_hex(quote(secret, safe=""))
    utf16 = secret.encode("utf-16-be")
    units = [int.from_bytes(utf16[i : i + 2], "big") for i in range(0, len(utf16), 2)]
    return {
        "raw": secret,
        "percent": quote(secret, safe=""),
        "percent lower-case": lower,
        "percent twice": quote(quote(secret, safe=""), safe=""),
        "percent twice, lower-case": lower_hex(quote(lower, safe="")),
        "hex": secret.encode().hex(),
        "HEX": secret.encode().hex().upper(),
        "json \\/": json.dumps(secret).replace("/", "\\/")[1:-1],
        "json \\u all": "".join(f"\\u{u:04x}" for u in units),
        "json \\U all": "".join(f"\\u{u:04X}" for u in units),
        "json as Go writes it": json.dumps(secret)[1:-1]
        .replace("<", "\\u003c")
        .replace(">", "\\u003e")
        .replace("&", "\\u0026"),
        "base64": base64.b64encode(secret.encode()).decode(),
    }


@pytest.mark.parametrize("secret", ["Tok/rel+0042==#@%canary", "Pw<x>&y/é€😀z"])
def test_every_encoding_of_a_secret_is_masked_and_ordinary_text_is_not(secret: str) -> None:
    from noetl_celery.config import secret_registry

    pattern = secret_registry.compile_masks({secret})
    for name, spelled in _encodings(secret).items():
        text = f'{{"a": "before {spelled} after"}}'
        assert secret_registry.mask_text(text, pattern) == '{"a": "before *** after"}', name
        assert scrub({"k": [text]}, {secret}) == {"k": ['{"a": "before *** after"}']}, name
    ordinary = "GET /a%2Fb?x=%41 \\u0041 \\/ deadbeef " + json.dumps({"t": "ordinary"})
    assert secret_registry.mask_text(ordinary, pattern) == ordinary


def test_a_long_secret_compiles_into_one_pattern() -> None:
    from noetl_celery.config import secret_registry

    key = "-----BEGIN KEY-----\n" + "QUJD/+" * 700 + "\n-----END KEY-----"  # 4,200 characters
    pattern = secret_registry.compile_masks({key, "other-secret"})
    assert pattern is not None
    assert secret_registry.mask_text(f"x{json.dumps(key)}y", pattern) == 'x"***"y'
    assert secret_registry.mask_text(f"x{key.encode().hex()}y", pattern) == "x***y"
