"""Alembic environment: runs the noetl_celery migrations on the configured database."""

from __future__ import annotations

from alembic import context
from sqlalchemy import pool

from noetl_celery import settings as noetl_settings
from noetl_celery.store.db import get_engine
from noetl_celery.store.models import Base

config = context.config
target_metadata = Base.metadata


def _url() -> str:
    return (
        config.attributes.get("noetl_url")
        or context.get_x_argument(as_dictionary=True).get("url")
        or noetl_settings.load().database_url
    )


def run_migrations_offline() -> None:
    context.configure(url=_url(), target_metadata=target_metadata, literal_binds=True)
    with context.begin_transaction():
        context.run_migrations()


def run_migrations_online() -> None:
    url = _url()
    if url.startswith("sqlite"):
        # SQLite DDL with the store's own engine (WAL, busy timeout); Alembic batches ALTERs.
        connectable = get_engine(url)
    else:
        from sqlalchemy import create_engine

        connectable = create_engine(url, poolclass=pool.NullPool)
    with connectable.connect() as connection:
        context.configure(connection=connection, target_metadata=target_metadata, render_as_batch=True)
        with context.begin_transaction():
            context.run_migrations()
        connection.commit()


if context.is_offline_mode():
    run_migrations_offline()
else:
    run_migrations_online()
