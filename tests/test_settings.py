"""Settings read from the environment, and the ones refused."""

from __future__ import annotations

from pathlib import Path

import pytest

from noetl_celery import settings
from noetl_celery.errors import ConfigurationError


def test_the_empty_environment_is_the_embedded_default(tmp_path):
    s = settings.load({"NOETL_HOME": str(tmp_path)})
    assert s.broker_url is None and s.database_url == f"sqlite:///{tmp_path / 'noetl.sqlite'}"
    assert (s.task_queue, s.event_queue, s.event_dispatch) == ("noetl.tasks", "noetl.events", "inline")
    assert s.max_countdown < s.visibility_timeout
    with pytest.raises(ConfigurationError, match="NOETL_BROKER_URL"):
        settings.require_broker(s)


def test_the_held_countdown_follows_a_short_visibility_timeout():
    assert settings.load({"NOETL_VISIBILITY_TIMEOUT": "8"}).max_countdown == 4


def test_a_countdown_held_past_the_visibility_timeout_is_refused():
    with pytest.raises(ConfigurationError, match="NOETL_MAX_COUNTDOWN .* must be shorter"):
        settings.load({"NOETL_VISIBILITY_TIMEOUT": "60", "NOETL_MAX_COUNTDOWN": "60"})


@pytest.mark.parametrize(
    "env, message",
    [
        ({"NOETL_EVENT_DISPATCH": "sometimes"}, "NOETL_EVENT_DISPATCH must be one of inline, queue"),
        ({"NOETL_VISIBILITY_TIMEOUT": "an hour"}, "NOETL_VISIBILITY_TIMEOUT must be a whole number"),
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


def test_the_config_listing_shows_every_variable_this_module_reads():
    import re

    source = Path(settings.__file__).read_text(encoding="utf-8")
    read = set(re.findall(r'"(NOETL_[A-Z_]+[A-Z])"', source)) - {settings.AUTH_PREFIX.rstrip("_")}
    shown = set(settings.load({"NOETL_AUTH_X": "v"}).masked())
    assert read - shown == set()
    assert "NOETL_AUTH_X" in shown
