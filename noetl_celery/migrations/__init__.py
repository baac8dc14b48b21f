"""The event store's Alembic migrations, shipped inside the package.

`noetl-celery migrate` and the embedded store find them with `importlib.resources`, so an
installed wheel can create and upgrade its schema. The top-level `alembic.ini` and `alembic/`
of the source tree point at the same `versions/` for developers who run `alembic` by hand.
"""

from __future__ import annotations

from collections.abc import Callable
from importlib.resources import files
from pathlib import Path
from typing import Any


def script_location() -> Path:
    """The directory Alembic reads (env.py, script.py.mako, versions/)."""
    return Path(str(files(__name__)))


def run_environment(engine_factory: Callable[[str], Any] | None = None) -> None:
    """Alembic's env.py body: run the migrations on the configured database.

    A SQLite store is migrated on the store's own engine (WAL, busy timeout): `engine_factory`,
    or the one store.db's Alembic configuration carries (`noetl_engine_factory`). The migrations
    never import the store's engines, which import them."""
    from alembic import context
    from sqlalchemy import create_engine, pool

    from noetl_celery.config import settings as noetl_settings
    from noetl_celery.store.models import Base

    config = context.config
    url = (
        config.attributes.get("noetl_url")
        or context.get_x_argument(as_dictionary=True).get("url")
        or noetl_settings.load().database_url
    )
    if context.is_offline_mode():
        context.configure(url=url, target_metadata=Base.metadata, literal_binds=True)
        with context.begin_transaction():
            context.run_migrations()
        return
    # SQLite DDL runs on the store's own engine (WAL, busy timeout); Alembic batches ALTERs.
    factory = engine_factory or config.attributes.get("noetl_engine_factory")
    if url.startswith("sqlite") and factory is not None:
        connectable = factory(url)
    else:
        connectable = create_engine(url, poolclass=pool.NullPool)
    with connectable.connect() as connection:
        context.configure(connection=connection, target_metadata=Base.metadata, render_as_batch=True)
        with context.begin_transaction():
            context.run_migrations()
        connection.commit()
