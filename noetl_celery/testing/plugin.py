"""The pytest plugin of noetl_celery.testing (registered as the `noetl_celery` pytest plugin when
the package is installed): the `noetl_playbook` fixture, `run_playbook` with its event store in
the test's temporary directory.

    def test_etl(noetl_playbook):
        run = noetl_playbook("playbooks/etl.yaml", mocks={"fetch": {"temp": 21}})
        assert run.status == "completed"
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest


@pytest.fixture
def noetl_playbook(tmp_path) -> Callable[..., Any]:
    """`noetl_celery.testing.run_playbook`, each run on a new SQLite store under `tmp_path`."""
    from noetl_celery.testing import run_playbook

    runs = iter(range(1_000_000))

    def run(playbook, **options: Any):
        options.setdefault("database_url", f"sqlite:///{tmp_path / f'noetl-{next(runs)}.sqlite'}")
        return run_playbook(playbook, **options)

    return run
