"""The `secrets` tool: read a secret by name from the credential sources `auth:` uses.

The name is `key` (alias `secret`), else the task's label (NoETL writes
`- name: TEST_SECRET, kind: secrets`); `auth:`/`credential:` may name it instead. It is resolved
by `credentials.resolve` (the env var NOETL_AUTH_<NAME>, then NOETL_CREDENTIALS_FILE).
`provider` is accepted for NoETL's `env`/`file`/`credentials`; cloud secret managers are refused.

Data: {name, provider, value}. The value and every secret inside it are handed to the worker's
masking, so event rows, logs and output show "***" in their place: a later step cannot read the
value from the step's result; it names the credential in its own `auth:` instead.
"""

from __future__ import annotations

from typing import Any

from pydantic import field_validator

from noetl_celery.config import credentials
from noetl_celery.core.errors import CredentialError
from noetl_celery.core.vocabulary import ToolErrorKind
from noetl_celery.tools.base import SECRET_VALUES_META, Outcome, ToolCall, register
from noetl_celery.tools.settings import ToolSettings

PROVIDERS = ("env", "file", "credentials", "local")
REFUSED_PROVIDERS = ("google", "gcp", "aws", "azure", "vault", "secret_manager")


class SecretsSettings(ToolSettings):
    key: str | None = None
    secret: str | None = None
    provider: str | None = None

    @field_validator("provider")
    @classmethod
    def _readable_provider(cls, value: str | None) -> str | None:
        if value is None or "{{" in value or value in PROVIDERS:
            return value
        sources = "NOETL_AUTH_<NAME> env vars or NOETL_CREDENTIALS_FILE"
        if value in REFUSED_PROVIDERS:
            raise ValueError(
                f"secrets provider '{value}' cannot run here: a cloud secret manager needs a cloud identity "
                f"a worker does not have; put the secret in {sources} and use provider "
                f"{' or '.join(PROVIDERS)}"
            )
        raise ValueError(
            f"secrets provider '{value}' is unknown: the secrets tool reads {sources}; "
            f"use one of {', '.join(PROVIDERS)}"
        )


def _secret_strings(value: Any) -> set[str]:
    found = credentials.secret_values(value)
    if isinstance(value, str) and value:
        found.add(value)  # a secret string is a secret even when it looks like a URL
    return found


@register("secrets", fields={"key", "secret", "provider", "credential"}, settings=SecretsSettings)
def run_secrets(call: ToolCall) -> Outcome:
    """Resolve the named secret; its value goes into the result, masked wherever it is written."""
    cfg = call.config
    name = cfg.get("key") or cfg.get("secret") or call.task
    value = call.credential
    if value is None:
        if not name:
            return Outcome.fail(ToolErrorKind.INVALID_ARGS, "secrets: name the secret with `key:` (or the task's name)")
        try:
            value = credentials.resolve(str(name))
        except CredentialError as exc:
            return Outcome.fail(ToolErrorKind.CREDENTIAL, f"secrets: {exc}")
    outcome = Outcome.ok({"name": name, "provider": cfg.get("provider") or "credentials", "value": value})
    outcome.meta[SECRET_VALUES_META] = sorted(_secret_strings(value))
    return outcome
