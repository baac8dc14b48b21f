"""Settings read from the environment, and the ones refused."""

from __future__ import annotations

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


@pytest.mark.parametrize("env, message", [
    ({"NOETL_EVENT_DISPATCH": "sometimes"}, "NOETL_EVENT_DISPATCH must be one of inline, queue"),
    ({"NOETL_VISIBILITY_TIMEOUT": "an hour"}, "NOETL_VISIBILITY_TIMEOUT must be a whole number"),
])
def test_bad_values_name_the_variable(env, message):
    with pytest.raises(ConfigurationError, match=message):
        settings.load(env)
