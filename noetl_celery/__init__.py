"""noetl_celery: run NoETL playbooks on Celery. `celery -A noetl_celery worker` finds `app` here."""

from noetl_celery.app import app

__all__ = ["app"]
__version__ = "0.1.0"
