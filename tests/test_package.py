"""The package as a user imports it: light to import, the Celery app made on first use and found
by `celery -A noetl_celery`, and no benchmark code in it."""

from __future__ import annotations

import json
import subprocess
import sys

from tests.support.engines import REPO_ROOT, _clean_env

HEAVY = ("celery", "kombu", "sqlalchemy", "alembic", "redis")
HELLO = REPO_ROOT / "playbooks" / "hello_world.yaml"


def python(code: str) -> subprocess.CompletedProcess:
    proc = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO_ROOT, env=_clean_env({}), capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr
    return proc


def loaded_after(statement: str) -> list[str]:
    proc = python(
        f"import sys\n{statement}\nimport json\nprint(json.dumps(sorted(m for m in {HEAVY!r} if m in sys.modules)))"
    )
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_importing_the_dsl_and_the_compiler_loads_neither_celery_nor_sqlalchemy():
    assert (
        loaded_after("import noetl_celery, noetl_celery.dsl, noetl_celery.compiler, noetl_celery.config.settings") == []
    )


def test_the_validate_command_loads_neither_celery_nor_sqlalchemy():
    code = (
        "import atexit, json, sys\n"
        f"atexit.register(lambda: print(json.dumps(sorted(m for m in {HEAVY!r} if m in sys.modules))))\n"
        "from noetl_celery.cli import main\n"
        f"sys.argv = ['noetl-celery', 'validate', {str(HELLO)!r}]\n"
        "main()\n"
    )
    proc = python(code)
    assert "valid canonical playbook" in proc.stdout
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == []


def test_the_commands_that_only_read_an_execution_load_neither_the_compiler_nor_celery(tmp_path):
    """`status` and `events` read the store: they start without the compiler, the DSL or Celery
    (an operator's script calls them in a loop)."""
    watched = ("noetl_celery.compiler", "noetl_celery.dsl", "noetl_celery.runner", "celery")
    for command in ("status", "events"):
        code = (
            "import atexit, json, sys\n"
            f"atexit.register(lambda: print(json.dumps(sorted(m for m in {watched!r} if m in sys.modules))))\n"
            "from noetl_celery.cli import main\n"
            f"sys.argv = ['noetl-celery', {command!r}, '42']\n"
            "main()\n"
        )
        proc = subprocess.run(
            [sys.executable, "-c", code],
            cwd=REPO_ROOT,
            env=_clean_env({"NOETL_HOME": str(tmp_path)}),
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert proc.returncode == 2 and "no execution 42 in sqlite:///" in proc.stderr, (command, proc.stderr)
        assert json.loads(proc.stdout.strip().splitlines()[-1]) == [], command


def test_celery_finds_the_app_whatever_was_imported_first():
    check = (
        "from celery import Celery\nfrom celery.app.utils import find_app\n"
        "found = find_app('noetl_celery')\nfrom noetl_celery.app import app\n"
        "assert isinstance(found, Celery) and found is app, found\n"
        "assert 'noetl.run_task' in app.tasks and 'noetl.on_event' in app.tasks\n"
        "assert not [name for name in app.tasks if 'bench' in name], list(app.tasks)\n"
        "print('ok')"
    )
    assert python(check).stdout.strip() == "ok"
    assert python("import noetl_celery.app\n" + check).stdout.strip() == "ok"
    assert (
        python(
            "import noetl_celery\nfrom noetl_celery.app import app as made\n"
            "assert noetl_celery.celery is made\n" + check
        ).stdout.strip()
        == "ok"
    )


def test_a_worker_command_line_finds_the_app():
    proc = subprocess.run(
        [sys.executable, "-m", "celery", "-A", "noetl_celery", "report"],
        cwd=REPO_ROOT,
        env=_clean_env({}),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert "noetl_celery" in proc.stdout or "software" in proc.stdout
