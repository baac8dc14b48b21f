"""Every module the documentation names exists: the dotted names (`noetl_celery.x.y`, then maybe
an attribute of the module) and the file paths (`noetl_celery/x/y.py`, or `engine/x.py` for a
file of the package named from its own folder) in docs/*.md, README.md and the package's own
source (docstrings, comments, strings). A module that moves leaves no stale name behind."""

from __future__ import annotations

import importlib
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "noetl_celery"
DOTTED = re.compile(r"(?<![\w.])noetl_celery(?:\.[A-Za-z_]\w*)+")
FILE = re.compile(r"(?<![\w./-])noetl_celery/(?:[\w.-]+/)*[\w.-]+\.(?:py|html|mako|yaml)\b")
# dotted names that are not modules: each a name of its own, kept as it is
NOT_MODULES = {
    "noetl_celery.sweeper",  # the sweeper's advisory lock key (engine/recovery/sweeper.py)
}
ROOMS = sorted(p.name for p in PACKAGE.iterdir() if p.is_dir() and (p / "__init__.py").is_file())
# a file of the package named from inside the package (`engine/worker.py`, `store/views.py`)
ROOM_FILE = re.compile(rf"(?<![\w./-])(?:{'|'.join(ROOMS)})/(?:[\w-]+/)*[\w-]+\.py\b")


def documents() -> list[Path]:
    docs = sorted((ROOT / "docs").glob("*.md")) + [ROOT / "README.md"]
    source = sorted(p for p in PACKAGE.rglob("*.py") if "__pycache__" not in p.parts)
    return docs + source


def text_of(path: Path) -> str:
    return path.read_text(encoding="utf-8")


def is_module(parts: list[str]) -> bool:
    path = ROOT.joinpath(*parts)
    return (path / "__init__.py").is_file() or path.with_suffix(".py").is_file()


def dotted_problem(name: str) -> str | None:
    """None when `name` is a module of the package, or a module then one attribute of it."""
    parts = name.split(".")
    n = 1
    while n < len(parts) and is_module(parts[: n + 1]):
        n += 1
    if n == len(parts):
        return None
    module, attribute = ".".join(parts[:n]), parts[n]
    if module == "noetl_celery":  # its attributes `app` and `celery` make the Celery app: not asked
        import noetl_celery

        found = attribute in noetl_celery.__all__ or attribute == "__version__"
        return None if found else f"no module noetl_celery.{attribute} (nor attribute {attribute} of it)"
    try:
        found = hasattr(importlib.import_module(module), attribute)
    except ImportError as exc:  # an optional library missing: the module itself is there
        return None if exc.name and not exc.name.startswith("noetl_celery") else f"{module} does not import"
    return None if found else f"no module {module}.{attribute} (nor attribute {attribute} of {module})"


def problems_in(path: Path) -> list[str]:
    text = text_of(path)
    where = path.relative_to(ROOT)
    found = []
    for match in sorted(set(DOTTED.findall(text)) - NOT_MODULES):
        if (problem := dotted_problem(match)) is not None:
            found.append(f"{where}: {match}: {problem}")
    for match in sorted(set(FILE.findall(text))):
        if not (ROOT / match).exists():
            found.append(f"{where}: {match}: no such file")
    for match in sorted(set(ROOM_FILE.findall(text))):
        if not (PACKAGE / match).exists():
            found.append(f"{where}: {match}: no such file in noetl_celery/")
    return found


def test_the_scan_reads_dotted_names_and_paths():
    assert dotted_problem("noetl_celery.config.settings") is None
    assert dotted_problem("noetl_celery.schedules.beat.StoreScheduler") is None
    assert dotted_problem("noetl_celery.settings") is not None
    assert dotted_problem("noetl_celery.config.settings.NO_SUCH_NAME") is not None
    assert FILE.findall("see noetl_celery/engine/context.py, and (noetl_celery/store/db.py).") == [
        "noetl_celery/engine/context.py",
        "noetl_celery/store/db.py",
    ]
    assert ROOM_FILE.findall("engine/context.py but not tests/engine/x.py nor noetl_celery/store/db.py") == [
        "engine/context.py"
    ]


@pytest.mark.parametrize("path", documents(), ids=lambda p: str(p.relative_to(ROOT)))
def test_every_module_named_exists(path: Path):
    assert problems_in(path) == []
