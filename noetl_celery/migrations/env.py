"""Alembic environment of the packaged migrations (see noetl_celery.migrations)."""

from noetl_celery.migrations import run_environment

run_environment()
