"""Settings read from the environment, and the ones refused."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from noetl_celery.config import settings
from noetl_celery.core.errors import ConfigurationError


def test_the_empty_environment_is_the_embedded_default(tmp_path):
    s = settings.load({"NOETL_HOME": str(tmp_path)})
    assert s.broker_url is None and s.database_url == f"sqlite:///{tmp_path / 'noetl.sqlite'}"
    assert (s.task_queue, s.event_queue, s.event_dispatch) == ("noetl.tasks", "noetl.events", "inline")
    assert s.max_countdown < s.visibility_timeout
    with pytest.raises(ConfigurationError, match="NOETL_BROKER_URL"):
        settings.require_broker(s)


@pytest.mark.parametrize(
    ("given", "used"),
    [
        ("postgresql://u:p@db:5432/noetl", "postgresql+psycopg2://u:p@db:5432/noetl"),
        ("postgres://u@db/noetl", "postgresql+psycopg2://u@db/noetl"),
        ("postgresql+psycopg2://u@db/noetl", "postgresql+psycopg2://u@db/noetl"),
        ("postgresql+psycopg://u@db/noetl", "postgresql+psycopg://u@db/noetl"),  # a driver named: kept
        ("sqlite:////tmp/x.sqlite", "sqlite:////tmp/x.sqlite"),
    ],
)
def test_a_postgresql_url_without_a_driver_uses_psycopg2(given, used):
    assert settings.load({"NOETL_DATABASE_URL": given}).database_url == used


def test_a_driverless_postgresql_url_reaches_the_store(postgres_url):
    """`postgresql://...` works as it is written (SQLAlchemy alone would want psycopg 3)."""
    from sqlalchemy import text

    from noetl_celery.store.db import get_engine

    driverless = postgres_url.replace("postgresql+psycopg2://", "postgresql://")
    url = settings.load({"NOETL_DATABASE_URL": driverless}).database_url
    with get_engine(url).connect() as conn:
        assert conn.execute(text("SELECT 1")).scalar() == 1


def test_the_held_countdown_follows_a_short_visibility_timeout():
    assert settings.load({"NOETL_VISIBILITY_TIMEOUT": "8"}).max_countdown == 4


def test_a_countdown_held_past_the_visibility_timeout_is_refused():
    with pytest.raises(ConfigurationError, match="NOETL_MAX_COUNTDOWN .* must be shorter"):
        settings.load({"NOETL_VISIBILITY_TIMEOUT": "60", "NOETL_MAX_COUNTDOWN": "60"})


AMQP = "amqp://guest:guest@127.0.0.1:5672//"


def test_on_rabbitmq_the_held_countdown_follows_the_consumer_timeout_not_the_visibility_timeout():
    s = settings.load({"NOETL_BROKER_URL": AMQP})
    assert s.amqp_broker and s.consumer_timeout == 1800 and s.max_countdown == 600
    assert settings.load({"NOETL_BROKER_URL": AMQP, "NOETL_CONSUMER_TIMEOUT": "60"}).max_countdown == 30
    # the visibility timeout is Redis's: it neither lowers nor limits a countdown on RabbitMQ
    s = settings.load({"NOETL_BROKER_URL": AMQP, "NOETL_VISIBILITY_TIMEOUT": "60", "NOETL_MAX_COUNTDOWN": "120"})
    assert s.max_countdown == 120
    assert not settings.load({"NOETL_BROKER_URL": "redis://h:6379/0"}).amqp_broker
    assert settings.load({"NOETL_BROKER_URL": "pyamqp://h//"}).amqp_broker


@pytest.mark.parametrize("countdown, timeout", [("1800", None), ("120", "120"), ("600", "300")])
def test_on_rabbitmq_a_countdown_held_past_the_consumer_timeout_is_refused(countdown, timeout):
    env = {"NOETL_BROKER_URL": AMQP, "NOETL_MAX_COUNTDOWN": countdown}
    if timeout:
        env["NOETL_CONSUMER_TIMEOUT"] = timeout
    with pytest.raises(ConfigurationError, match="NOETL_MAX_COUNTDOWN .* must be shorter than NOETL_CONSUMER_TIMEOUT"):
        settings.load(env)
    with pytest.raises(ConfigurationError, match="NOETL_CONSUMER_TIMEOUT must be a positive"):
        settings.load({"NOETL_BROKER_URL": AMQP, "NOETL_CONSUMER_TIMEOUT": "0"})


def test_broker_options_follow_the_kind_of_broker():
    from noetl_celery.app import broker_options

    redis = broker_options(settings.load({"NOETL_BROKER_URL": "redis://h:6379/0", "NOETL_VISIBILITY_TIMEOUT": "80"}))
    assert redis["visibility_timeout"] == 80
    assert redis["broker_transport_options"]["visibility_timeout"] == 80
    assert redis["result_backend_transport_options"] == {"visibility_timeout": 80}
    amqp = broker_options(settings.load({"NOETL_BROKER_URL": AMQP}))
    assert amqp == {"broker_transport_options": {"confirm_publish": True}}  # no Redis-only option


@pytest.mark.parametrize(
    "env, message",
    [
        ({"NOETL_EVENT_DISPATCH": "sometimes"}, "NOETL_EVENT_DISPATCH must be one of inline, queue"),
        ({"NOETL_VISIBILITY_TIMEOUT": "an hour"}, "NOETL_VISIBILITY_TIMEOUT must be a whole number"),
        ({"NOETL_MAX_RESULT_BYTES": "1MB"}, "NOETL_MAX_RESULT_BYTES must be a positive whole number, got '1MB'"),
        ({"NOETL_MAX_PLAYBOOK_BYTES": "0"}, "NOETL_MAX_PLAYBOOK_BYTES must be a positive whole number"),
        ({"NOETL_MAX_YAML_NODES": "0.5"}, "NOETL_MAX_YAML_NODES must be a positive whole number"),
        ({"NOETL_TEMPLATE_MAX_BYTES": "inf"}, "NOETL_TEMPLATE_MAX_BYTES must be a positive whole number"),
        ({"NOETL_TEMPLATE_TIMEOUT": "-1"}, "NOETL_TEMPLATE_TIMEOUT must be a positive number of seconds"),
        ({"NOETL_TEMPLATE_TIMEOUT": "nan"}, "NOETL_TEMPLATE_TIMEOUT must be a positive number of seconds"),
    ],
)
def test_bad_values_name_the_variable(env, message):
    with pytest.raises(ConfigurationError, match=message):
        settings.load(env)


SECRET_ENV = {
    "NOETL_BROKER_URL": "redis://:brokerpw-9d1@127.0.0.1:6379/3",
    "NOETL_DATABASE_URL": "postgresql+psycopg2://noetl:dbpw-9d1@127.0.0.1:5432/noetl",
    "NOETL_AUTH_API_TOKEN": '{"type": "bearer", "token": "tokenvalue-9d1"}',
    "NOETL_AUTH_PG_LOCAL": "postgresql://u:pgpw-9d1@db/x",
    "NOETL_POSTGRES_DSN": "host=db password=dsnpw-9d1",
    "NOETL_CREDENTIALS_FILE": "/etc/noetl/credentials.yaml",
    "NOETL_CORPUS_DIR": "/opt/noetl/tests/fixtures/playbooks",
}


def test_every_noetl_variable_is_read_here_and_secrets_are_masked():
    s = settings.load(SECRET_ENV)
    assert s.auth["NOETL_AUTH_PG_LOCAL"].endswith("/x") and s.postgres_dsn == "host=db password=dsnpw-9d1"
    assert str(s.credentials_file) == "/etc/noetl/credentials.yaml"
    assert str(s.corpus_dir) == "/opt/noetl/tests/fixtures/playbooks"
    shown = s.masked()
    assert shown["NOETL_BROKER_URL"] == "redis://:***@127.0.0.1:6379/3"
    assert shown["NOETL_DATABASE_URL"] == "postgresql+psycopg2://noetl:***@127.0.0.1:5432/noetl"
    assert shown["NOETL_AUTH_API_TOKEN"] == shown["NOETL_AUTH_PG_LOCAL"] == shown["NOETL_POSTGRES_DSN"] == "***"
    for text in (repr(s), str(shown)):
        assert "9d1" not in text


def test_the_corpus_defaults_to_the_shared_folder_beside_the_checkout():
    assert settings.load({}).corpus_dir == (settings.SOURCE_ROOT.parent / "shared" / "noetl-corpus").resolve()


def test_the_config_command_prints_the_effective_settings_masked(tmp_path):
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if not k.startswith("NOETL_")}
    env.update(SECRET_ENV, NOETL_HOME=str(tmp_path))
    proc = subprocess.run(
        [sys.executable, "-m", "noetl_celery.cli", "config"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        cwd=settings.SOURCE_ROOT,
    )
    assert proc.returncode == 0, proc.stderr
    lines = dict(line.split("=", 1) for line in proc.stdout.splitlines())
    assert lines["NOETL_HOME"] == str(tmp_path) and lines["NOETL_AUTH_API_TOKEN"] == "***"
    assert lines["NOETL_DATABASE_URL"].endswith(":***@127.0.0.1:5432/noetl")
    assert lines["NOETL_MAX_RESULT_BYTES"] == "1000000 bytes" and lines["NOETL_TEMPLATE_TIMEOUT"] == "5 s"
    assert "9d1" not in proc.stdout + proc.stderr


def test_the_tool_and_sub_playbook_folders_are_read_here_too(tmp_path):
    import os

    s = settings.load(
        {
            "NOETL_DUCKDB_DIR": str(tmp_path / "duck"),
            "NOETL_PLAYBOOK_PATH": os.pathsep.join([str(tmp_path / "a"), "", str(tmp_path / "b")]),
        }
    )
    assert s.duckdb_dir == tmp_path / "duck"
    assert s.playbook_path == (tmp_path / "a", tmp_path / "b")
    assert settings.load({}).duckdb_dir == settings.DEFAULT_DUCKDB_DIR and settings.load({}).playbook_path == ()
    assert s.masked()["NOETL_PLAYBOOK_PATH"] == os.pathsep.join([str(tmp_path / "a"), str(tmp_path / "b")])


def test_the_limits_are_read_here_and_when_used(monkeypatch):
    from noetl_celery.config import limits

    s = settings.load({"NOETL_MAX_RESULT_BYTES": "1e6", "NOETL_MAX_YAML_NODES": "10", "NOETL_TEMPLATE_TIMEOUT": "0.5"})
    assert (s.max_result_bytes, s.max_yaml_nodes, s.template_timeout) == (1_000_000, 10, 0.5)
    assert (s.max_playbook_bytes, s.template_max_bytes) == (4_000_000, 1_000_000)
    assert s.masked()["NOETL_MAX_YAML_NODES"] == "10" and s.masked()["NOETL_TEMPLATE_TIMEOUT"] == "0.5 s"
    for name in settings.LIMIT_DEFAULTS:
        monkeypatch.delenv(name, raising=False)
    assert (limits.max_result_bytes(), limits.max_playbook_bytes(), limits.max_yaml_nodes()) == (
        1_000_000,
        4_000_000,
        500_000,
    )
    assert (limits.template_timeout(), limits.template_max_bytes()) == (5.0, 1_000_000)
    monkeypatch.setenv("NOETL_TEMPLATE_MAX_BYTES", "2048")
    assert limits.template_max_bytes() == 2048  # read again on every call, not once at import
    monkeypatch.setenv("NOETL_MAX_RESULT_BYTES", "lots")
    with pytest.raises(ConfigurationError, match="NOETL_MAX_RESULT_BYTES must be a positive whole number"):
        limits.max_result_bytes()


PACKAGE = Path(settings.__file__).resolve().parents[1]  # noetl_celery/ (settings is config/settings.py)
SETTINGS_MODULE = PACKAGE / "config" / "settings.py"
# the environment layer settings reads through (secret_registry.environ): it seals the credential
# and URL variables away from user code and masks their values, so it names those itself
ENVIRONMENT_LAYER = PACKAGE / "config" / "secret_registry.py"
VARIABLE_NAME = re.compile(r"NOETL_[A-Z0-9_]*\Z")


def variables_named(source: str) -> set[str]:
    """The NOETL_* variable names (or name prefixes) `source` spells out as strings of their own:
    what it could read from the environment, however it reads it. Names inside longer text
    (messages, docstrings) are left out."""
    return {
        node.value
        for node in ast.walk(ast.parse(source))
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and VARIABLE_NAME.match(node.value)
    }


def test_the_scan_finds_a_variable_however_it_is_read():
    source = """
import os
A = os.environ.get("NOETL_NEW_LIMIT", "1")
B = os.getenv(f"NOETL_AUTH_{name}")
C = env["NOETL_OTHER"]
D = f"{x} bytes, more than the limit (NOETL_MAX_RESULT_BYTES)"
E = f"NOETL_BROKER_URL {url} is not a valid URL"
"""
    assert variables_named(source) == {"NOETL_NEW_LIMIT", "NOETL_AUTH_", "NOETL_OTHER"}


def test_the_config_listing_shows_every_variable_this_module_reads():
    read = variables_named(SETTINGS_MODULE.read_text(encoding="utf-8"))
    read |= variables_named(ENVIRONMENT_LAYER.read_text(encoding="utf-8"))
    prefixes = {name for name in read if name.endswith("_")}
    assert prefixes == {settings.AUTH_PREFIX, settings.MCP_SERVER_PREFIX}  # credentials, mcp servers by name
    shown = set(settings.load({"NOETL_AUTH_X": "v", "NOETL_MCP_BOX_URL": "http://127.0.0.1:1/mcp"}).masked())
    assert read - prefixes - shown == set()
    assert "NOETL_AUTH_X" in shown and "NOETL_MCP_BOX_URL" in shown
    assert set(settings.LIMIT_DEFAULTS) <= read


def test_no_other_module_reads_a_noetl_variable():
    """Every NOETL_* variable is read in config/settings.py (and so shown by `noetl-celery config`)."""
    elsewhere = {
        str(path.relative_to(PACKAGE)): sorted(names)
        for path in sorted(PACKAGE.rglob("*.py"))
        if path not in (SETTINGS_MODULE, ENVIRONMENT_LAYER)
        and (names := variables_named(path.read_text(encoding="utf-8")))
    }
    assert elsewhere == {}, "read these in noetl_celery/config/settings.py and show them in Settings.masked()"


def test_the_message_format_a_deployment_writes_is_at_most_the_newest_this_release_reads():
    """NOETL_MESSAGE_FORMAT: the newest format written (engine/messages.py); a rolling upgrade
    sets the one the release being replaced reads. Out of 1..READ_VERSION it is refused."""
    from noetl_celery.engine.messages import READ_VERSION, written_formats

    assert settings.NEWEST_MESSAGE_FORMAT == READ_VERSION == settings.load({}).message_format
    assert settings.check(settings.load({"NOETL_MESSAGE_FORMAT": "2"})).message_format == 2
    with pytest.raises(ConfigurationError, match="NOETL_MESSAGE_FORMAT must be a message format from 1 to"):
        settings.check(settings.load({"NOETL_MESSAGE_FORMAT": str(READ_VERSION + 1)}))
    for wrong in ("0", "two"):
        with pytest.raises(ConfigurationError, match="NOETL_MESSAGE_FORMAT must be a positive whole number"):
            settings.load({"NOETL_MESSAGE_FORMAT": wrong})
    assert written_formats() == READ_VERSION
