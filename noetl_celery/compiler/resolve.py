"""Where a sub-playbook's catalog path (its `metadata.path`) is found.

Order: the catalog in the store (`noetl-celery register FILE...`), then playbook files whose
`metadata.path` matches: beside the parent file, then under each directory of
NOETL_PLAYBOOK_PATH (os.pathsep-separated, searched recursively). A file's metadata.path is read
once per (file, mtime) per process.
"""

from __future__ import annotations

import difflib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from noetl_celery import settings as noetl_settings

PLAYBOOK_PATH_ENV = noetl_settings.PLAYBOOK_PATH_ENV
PLAYBOOK_SUFFIXES = (".yaml", ".yml")
MAX_FILES_SCANNED = 5000  # per directory tree; a search never reads more files than this

_metadata_paths: dict[tuple[str, float], str | None] = {}


@dataclass(frozen=True)
class Found:
    """A sub-playbook's text and where it came from (a file, or `catalog:<path>`)."""

    path: str
    source: str
    text: str


Catalog = Callable[[str], Found | None]


def metadata_path(file: Path) -> str | None:
    try:
        key = (str(file), file.stat().st_mtime)
    except OSError:
        return None
    if key not in _metadata_paths:
        try:
            document: Any = yaml.safe_load(file.read_text(encoding="utf-8"))
        except (OSError, yaml.YAMLError, UnicodeDecodeError):
            document = None
        meta = document.get("metadata") if isinstance(document, dict) else None
        value = meta.get("path") if isinstance(meta, dict) else None
        _metadata_paths[key] = value if isinstance(value, str) else None
    return _metadata_paths[key]


def search_dirs(parent_file: str | None) -> list[tuple[Path, bool]]:
    """(directory, recursive) pairs, in search order."""
    dirs: list[tuple[Path, bool]] = []
    if parent_file and not parent_file.startswith("catalog:"):
        dirs.append((Path(parent_file).resolve().parent, False))
    for entry in noetl_settings.load().playbook_path:
        dirs.append((entry, True))
    return dirs


def playbook_files(parent_file: str | None) -> Iterator[tuple[Path, Path]]:
    """(search directory, playbook file) for each playbook file in the search directories, in
    order, at most MAX_FILES_SCANNED of each directory."""
    for directory, recursive in search_dirs(parent_file):
        if not directory.is_dir():
            continue
        files = directory.rglob("*") if recursive else directory.iterdir()
        for count, file in enumerate(sorted(f for f in files if f.suffix in PLAYBOOK_SUFFIXES)):
            if count >= MAX_FILES_SCANNED:
                break
            yield directory, file


def find_file(catalog_path: str, parent_file: str | None) -> Path | None:
    return next((file for _, file in playbook_files(parent_file) if metadata_path(file) == catalog_path), None)


def find(catalog_path: str, parent_file: str | None, catalog: Catalog | None = None) -> Found | None:
    if catalog is not None:
        found = catalog(catalog_path)
        if found is not None:
            return found
    file = find_file(catalog_path, parent_file)
    if file is None:
        return None
    return Found(path=catalog_path, source=str(file), text=file.read_text(encoding="utf-8"))


def known_playbooks(parent_file: str | None) -> dict[str, str]:
    """What a sub-playbook path could have meant: {name: the metadata.path it stands for}, for
    each playbook file in the search directories, by its metadata.path and by its file path
    (relative to its directory, with and without its suffix, and absolute)."""
    known: dict[str, str] = {}
    for directory, file in playbook_files(parent_file):
        path = metadata_path(file)
        if path is None:
            continue
        known.setdefault(path, path)
        relative = file.relative_to(directory)
        for name in (str(relative), str(relative.with_suffix("")), str(file)):
            known.setdefault(name, path)
    return known


def not_found_message(catalog_path: str, parent_file: str | None, catalog: Catalog | None = None) -> str:
    places = ", ".join(str(d) for d, _ in search_dirs(parent_file)) or "(no directory)"
    message = (
        f"sub-playbook {catalog_path!r} not found: not registered (noetl-celery register FILE) and no "
        f"playbook with that metadata.path in {places} (more directories: {PLAYBOOK_PATH_ENV})"
    )
    return message + nearest_playbook(catalog_path, parent_file, catalog)


def nearest_playbook(catalog_path: str, parent_file: str | None, catalog: Catalog | None = None) -> str:
    """ "; did you mean 'x'?" naming the nearest registered path or playbook file ("" for none).
    A file named by its file path rather than its metadata.path is named with the path to write."""
    known = known_playbooks(parent_file)
    listed = getattr(catalog, "paths", None)
    if callable(listed):
        for path in listed():
            known.setdefault(path, path)
    if catalog_path in known:  # a file's own path: it is found by its metadata.path
        return f"; the file {catalog_path!r} has metadata.path {known[catalog_path]!r}: name it by that path"
    close = difflib.get_close_matches(catalog_path, list(known), n=1, cutoff=0.6)
    if not close:
        return ""
    target = known[close[0]]
    return f"; did you mean {target!r}?" if close[0] == target else f"; did you mean {target!r} ({close[0]})?"


def is_template(value: Any) -> bool:
    return isinstance(value, str) and ("{{" in value or "{%" in value)
