"""The secret registry: every value that must never be written, and the mask that hides it.

Decides which strings are secret and in which forms they are hidden. The engine consults this one
registry wherever it writes (event rows, variables, execution errors, task messages, logs, CLI
output) instead of scrubbing in scattered places.

Which values:
- every configured credential: each NOETL_AUTH_* variable and each entry of the credentials file
  (NOETL_CREDENTIALS_FILE), through `secret_values.secret_values` (tokens, passwords, header values,
  the password inside a DSN or URL, basic-auth pairs);
- the password of the store, broker, result-backend and default postgres URLs
  (NOETL_DATABASE_URL, NOETL_BROKER_URL, NOETL_RESULT_BACKEND, NOETL_POSTGRES_DSN);
- any value given to `register()` (a tool that reads a secret at run time registers it).

In which forms each value is hidden: as is; percent-encoded (any characters of it, upper- or
lower-case hex, once or twice: `%2F`, `%2f`, `%252F`), form-encoded (`+`); JSON-escaped (`\\"`,
`\\/`, `\\uXXXX` in either case, for any of its characters); hex of its UTF-8 bytes (either case);
base64 (standard and URL-safe, at each of the three byte alignments, so a secret inside a longer
base64 text is found too). All of them are one regex, compiled once per set of secrets.
What code writes to file descriptors 1 and 2 itself is masked by noetl_celery/observe/fd_masking.py.

`seal_environment()` moves the credential variables out of os.environ into this module, so code
run by the python tool cannot read them; `environ()` is the environment as the engine reads it.

Values shorter than MIN_SECRET_LENGTH are not masked (they would mangle ordinary text).
"""

from __future__ import annotations

import base64
import json
import logging
import os
import re
import threading
from collections.abc import Callable, Mapping
from typing import Any
from urllib.parse import quote, quote_plus

from noetl_celery.config.secret_values import load_file_entries, secret_values
from noetl_celery.core.errors import CredentialError

MASK = "***"
MIN_SECRET_LENGTH = 4  # characters; shorter values are not masked
MIN_BASE64_CORE = 6  # characters of a partial (unaligned) base64 form worth masking
CREDENTIAL_PREFIX = "NOETL_AUTH_"
CREDENTIALS_FILE_VAR = "NOETL_CREDENTIALS_FILE"
URL_VARS = ("NOETL_DATABASE_URL", "NOETL_BROKER_URL", "NOETL_RESULT_BACKEND", "NOETL_POSTGRES_DSN")

_lock = threading.RLock()
_registered: set[str] = set()
_sealed: dict[str, str] = {}
_cache: dict[str, Any] = {"key": None, "pattern": None}


def _is_sealed_name(name: str) -> bool:
    return name.startswith(CREDENTIAL_PREFIX) or name == CREDENTIALS_FILE_VAR or name in URL_VARS


def environ() -> dict[str, str]:
    """The environment as the engine reads it: os.environ plus the sealed credential variables
    (a variable set again in os.environ after sealing wins)."""
    with _lock:
        return {**_sealed, **os.environ}


def getenv(name: str, default: str | None = None) -> str | None:
    value = os.environ.get(name)
    if value is not None:
        return value
    with _lock:
        return _sealed.get(name, default)


def seal_environment() -> None:
    """Move NOETL_AUTH_*, NOETL_CREDENTIALS_FILE and the store/broker URLs out of os.environ.

    Their values stay readable through `environ()`/`getenv()` and stay registered for masking.
    Code run by the python tool sees an os.environ without them.
    """
    with _lock:
        moved = [name for name, _ in _environment_key() if _is_sealed_name(_text(name))]
        for name in moved:
            _sealed[_text(name)] = os.environ.pop(_text(name))
        if moved:  # the secrets did not change, but where they are read from did
            _cache["key"] = None


def register(value: Any) -> None:
    """Mask `value` (a string, or a credential: a mapping or a DSN) from now on, in this process."""
    values = {value} if isinstance(value, str) and not _looks_structured(value) else secret_values(value)
    if isinstance(value, str):
        values |= secret_values(value)
    with _lock:
        before = len(_registered)
        _registered.update(v for v in values if isinstance(v, str) and len(v) >= MIN_SECRET_LENGTH)
        if len(_registered) != before:
            _cache["key"] = None


def _looks_structured(value: str) -> bool:
    return "://" in value or bool(re.search(r"(?:^|\s)password\s*=", value))


def _configured_values() -> set[str]:
    """The secret strings of the environment and the credentials file, as configured now."""
    env = environ()
    found: set[str] = set()
    for name, raw in env.items():
        if name.startswith(CREDENTIAL_PREFIX) and raw.strip():
            text = raw.strip()
            value: Any = text
            if text.startswith("{"):
                try:
                    value = json.loads(text)
                except json.JSONDecodeError:
                    value = text
            found |= secret_values(value)
            if isinstance(value, str) and not _looks_structured(text):
                found.add(text)
        elif name in URL_VARS and raw:
            found |= secret_values({"url": raw})
    path = env.get(CREDENTIALS_FILE_VAR)
    if path:
        try:
            entries = load_file_entries(path)
        except CredentialError:
            entries = {}
        for entry in entries.values():
            found |= secret_values(entry)
    return found


_SEALED_STARTS = (CREDENTIAL_PREFIX, CREDENTIALS_FILE_VAR, *URL_VARS)  # what sealed names start with
_SEALED_STARTS_RAW = tuple(os.fsencode(start) for start in _SEALED_STARTS)
_SEALED_FAMILY = os.path.commonprefix(_SEALED_STARTS)  # what every one of them starts with (NOETL_)
# os.environ's own table holds the names as bytes, as str on Windows (the os module's encodekey)
_RAW_FAMILY, _RAW_STARTS = (
    (_SEALED_FAMILY, _SEALED_STARTS) if os.name == "nt" else (os.fsencode(_SEALED_FAMILY), _SEALED_STARTS_RAW)
)
_FAMILY_LENGTH = len(_SEALED_FAMILY)


def _environment_key() -> tuple[Any, ...]:
    """What of os.environ the configured secrets depend on: the variables whose names start like
    a sealed one's. Read from the process's raw environment table where there is one, without
    decoding every variable, and a name compared with the sealed starts only when it starts with
    NOETL_ (this runs before every masking pass)."""
    data = getattr(os.environ, "_data", None)
    if isinstance(data, dict):
        return tuple(
            [
                (name, data[name])
                for name in data
                if name[:_FAMILY_LENGTH] == _RAW_FAMILY and name.startswith(_RAW_STARTS)
            ]
        )
    return tuple((k, v) for k, v in os.environ.items() if k.startswith(_SEALED_STARTS))


def _text(name: str | bytes) -> str:
    return name if isinstance(name, str) else os.fsdecode(name)


def _fingerprint() -> tuple[Any, ...]:
    """Changes whenever the secrets to mask may have: the NOETL_* environment (sealing clears
    the cache itself), the credentials file's modification time, the registered values."""
    relevant = _environment_key()
    path = getenv(CREDENTIALS_FILE_VAR)
    mtime = None
    if path:
        try:
            mtime = os.stat(path).st_mtime
        except OSError:
            mtime = None
    return relevant, mtime, len(_registered)


def _lower_hex(text: str) -> str:
    """Percent-encoding with lower-case hex digits (`%2f`: as valid as `%2F`, RFC 3986)."""
    return _PERCENT.sub(lambda m: m.group(0).lower(), text)


_PERCENT = re.compile(r"%[0-9A-F]{2}")
_HTML_ESCAPES = {"<": "\\u003c", ">": "\\u003e", "&": "\\u0026"}  # JSON as Go and some JS encoders write it


def forms(secret: str) -> set[str]:
    """The spellings of one secret that are masked (every one generated here, once per secret).

    As is; percent-encoded (everything reserved, or `/` kept, or form-encoded, or as
    JavaScript's encodeURIComponent leaves it), each with upper- and lower-case hex, once and
    twice (`%2F`, `%2f`, `%252F`, `%252f`); JSON-escaped (with non-ASCII kept or `\\u`-escaped,
    with `/` as `\\/`, with `<>&` as `\\u003c`..., and every character as `\\uXXXX` in lower- and
    upper-case hex); hex of its UTF-8 bytes (both cases); base64 (standard and URL-safe, on its
    own and inside a longer base64 text at each of the three byte alignments)."""
    percent = {quote(secret, safe=""), quote(secret), quote_plus(secret), quote(secret, safe="!'()*~")}
    percent |= {_lower_hex(once) for once in percent}
    percent |= {quote(once, safe="") for once in percent}  # `%` itself encoded: `%252F`, `%252f`
    escaped = json.dumps(secret)[1:-1]
    every = "".join(f"\\u{unit:04x}" for unit in _utf16_units(secret))
    out = {
        secret,
        *percent,
        escaped,
        json.dumps(secret, ensure_ascii=False)[1:-1],
        escaped.replace("/", "\\/"),
        "".join(_HTML_ESCAPES.get(c, c) for c in escaped),
        "".join(_HTML_ESCAPES[c].upper().replace("\\U", "\\u") if c in _HTML_ESCAPES else c for c in escaped),
        every,
        every.upper().replace("\\U", "\\u"),
    }
    raw = secret.encode("utf-8")
    out |= {raw.hex(), raw.hex().upper()}
    for encode in (base64.b64encode, base64.urlsafe_b64encode):
        whole = encode(raw).decode("ascii")
        out |= {whole, whole.rstrip("=")}  # the secret encoded on its own: every character masked
        for pad in range(3):
            text = encode(b"\0" * pad + raw).decode("ascii").rstrip("=")
            start = (0, 2, 3)[pad]  # characters that depend on the bytes before the secret
            end = len(text) - (1 if (pad + len(raw)) % 3 else 0)  # ... and on the bytes after it
            core = text[start:end]
            if len(core) >= MIN_BASE64_CORE or (pad == 0 and len(core) >= MIN_SECRET_LENGTH):
                out.add(core)
    return {f for f in out if len(f) >= MIN_SECRET_LENGTH}


def _utf16_units(text: str) -> list[int]:
    data = text.encode("utf-16-be")
    return [int.from_bytes(data[i : i + 2], "big") for i in range(0, len(data), 2)]


def compile_masks(values: Any) -> re.Pattern[str] | None:
    """One regex matching every form of each of `values` (strings shorter than MIN_SECRET_LENGTH
    are left out), longest first; None when there is none. The forms are merged into a prefix
    tree, so a text is scanned about as fast as for one alternative whatever their number."""
    words: set[str] = set()
    for value in values:
        if isinstance(value, str) and len(value) >= MIN_SECRET_LENGTH:
            words |= forms(value)
    return re.compile(_tree_regex(words)) if words else None


def _tree_regex(words: set[str]) -> str:
    """A regex matching exactly `words`, the longest at a position first, shared prefixes merged."""
    root: dict[str, Any] = {}
    for word in words:
        node = root
        for char in word:
            node = node.setdefault(char, {})
        node[""] = {}  # a word ends here

    def build(node: dict[str, Any]) -> str:
        chain: list[str] = []  # a run of single characters is one literal (no recursion per character)
        while len(node) == 1 and "" not in node:
            [(char, node)] = node.items()
            chain.append(re.escape(char))
        branches = [re.escape(char) + build(child) for char, child in sorted(node.items()) if char]
        if not branches:
            return "".join(chain)
        body = branches[0] if len(branches) == 1 else "(?:" + "|".join(branches) + ")"
        return "".join(chain) + (f"(?:{body})?" if "" in node else body)

    return build(root)


def _pattern() -> re.Pattern[str] | None:
    with _lock:
        key = _fingerprint()
        if _cache["key"] == key:
            return _cache["pattern"]
        pattern = compile_masks(_configured_values() | _registered)
        _cache["key"], _cache["pattern"] = key, pattern
        return pattern


def mask_text(text: str, pattern: re.Pattern[str] | None = None) -> str:
    """`text` with every form of every secret replaced by MASK."""
    pattern = pattern if pattern is not None else _pattern()
    if pattern is None or not text:
        return text
    return pattern.sub(MASK, text)


def mask(value: Any) -> Any:
    """A copy of a JSON-like value (keys included) with every secret form replaced by MASK."""
    pattern = _pattern()
    if pattern is None:
        return value
    return _mask(value, pattern)


def masker(*, masked: bool = False) -> Callable[[Any], Any]:
    """`mask` with the secrets known now, looked up once: for the many parts of one value
    (`masked`: the value is masked already, and this gives it back as it is)."""
    pattern = None if masked else _pattern()
    if pattern is None:
        return _unmasked
    return lambda value: _mask(value, pattern)


def _unmasked(value: Any) -> Any:
    return value


def _mask(value: Any, pattern: re.Pattern[str]) -> Any:
    if isinstance(value, str):
        return pattern.sub(MASK, value)
    if isinstance(value, Mapping):
        return {(_mask(k, pattern) if isinstance(k, str) else k): _mask(v, pattern) for k, v in value.items()}
    if isinstance(value, list):
        return [_mask(v, pattern) for v in value]
    if isinstance(value, tuple):
        return tuple(_mask(v, pattern) for v in value)
    if isinstance(value, bytes):
        return pattern.sub(MASK, value.decode("utf-8", "replace")).encode("utf-8")
    return value


class MaskingFilter(logging.Filter):
    """A logging filter that masks every secret form in a record's message and traceback."""

    def filter(self, record: logging.LogRecord) -> bool:
        pattern = _pattern()
        if pattern is None:
            return True
        try:
            message = record.getMessage()
        except Exception:  # a malformed record is logged as it is
            return True
        record.msg, record.args = pattern.sub(MASK, message), ()
        if record.exc_info and not record.exc_text:
            record.exc_text = logging.Formatter().formatException(record.exc_info)
        if record.exc_text:
            record.exc_text = pattern.sub(MASK, record.exc_text)
        if record.stack_info:
            record.stack_info = pattern.sub(MASK, record.stack_info)
        return True


_FILTER = MaskingFilter()


def install_log_filter(*loggers: logging.Logger) -> None:
    """Add the masking filter to every handler of the root logger and of `loggers` (once each)."""
    for logger in (logging.getLogger(), *loggers):
        for handler in logger.handlers:
            if _FILTER not in handler.filters:
                handler.addFilter(_FILTER)
