"""`GET /metrics`: the server's Prometheus exposition (noetl_celery/dashboard/collector.py).

Open like the pages (read-only, no token), in Prometheus's text format; the reads run on a
thread so the server stays responsive while the store answers.
"""

from __future__ import annotations

import asyncio
from typing import Any

import tornado.web
from prometheus_client import CONTENT_TYPE_LATEST

from noetl_celery.config import settings as noetl_settings
from noetl_celery.dashboard import collector


def _celery_app() -> Any:
    from noetl_celery.app import app

    return app


class MetricsPage(tornado.web.RequestHandler):
    def initialize(self, settings: noetl_settings.Settings, **_: Any) -> None:
        broker = _celery_app if settings.broker_url else None  # the embedded broker has no queues to show
        self.registry = collector.registry(settings, broker)

    async def get(self) -> None:
        body = await asyncio.get_running_loop().run_in_executor(None, collector.exposition, self.registry)
        self.set_header("Content-Type", CONTENT_TYPE_LATEST)
        self.set_header("Cache-Control", "no-store")
        self.finish(body)


def routes(common: dict[str, Any]) -> list[tuple[str, type, dict[str, Any]]]:
    return [(r"/metrics", MetricsPage, common)]
