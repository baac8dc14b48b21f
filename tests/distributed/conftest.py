"""Fixtures for tests that drive real worker processes on Redis + PostgreSQL directly."""

from __future__ import annotations

import pytest

from noetl_celery.store.db import migrate


@pytest.fixture(scope="module")
def store_url(postgres_url) -> str:
    migrate(postgres_url)
    return postgres_url


@pytest.fixture
def env(redis_url, store_url) -> dict[str, str]:
    """What both the workers and the submitting command see."""
    return {"NOETL_BROKER_URL": redis_url, "NOETL_DATABASE_URL": store_url}
