"""Fixtures for tests that drive real worker processes on Redis (or RabbitMQ) + PostgreSQL directly.

`tests.support.services.on_both_brokers` runs a test once on Redis and once on RabbitMQ."""

from __future__ import annotations

import pytest

from noetl_celery.store.db import migrate


@pytest.fixture(scope="module")
def store_url(postgres_url) -> str:
    migrate(postgres_url)
    return postgres_url


@pytest.fixture
def env(broker_url, store_url) -> dict[str, str]:
    """What both the workers and the submitting command see (Redis unless the test asks)."""
    return {"NOETL_BROKER_URL": broker_url, "NOETL_DATABASE_URL": store_url}
