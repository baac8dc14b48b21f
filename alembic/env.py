"""Alembic environment for developers who run `alembic` from the source tree.

The migrations themselves live in the package (noetl_celery/migrations/versions, see
alembic.ini's version_locations), so an installed wheel carries them too.
"""

from noetl_celery.migrations import run_environment
from noetl_celery.store.db import get_engine

run_environment(get_engine)
