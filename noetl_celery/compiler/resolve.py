"""Where a sub-playbook named by its catalog path (its `metadata.path`) or its file is found.

Order: the catalog in the store (`noetl-celery register FILE...`); a file path relative to the
parent file's folder when the name is written as one (`./child.yaml`, `../x.yaml`, `setup/x.yaml`:
it starts with ./ or ../ or ends in .yaml/.yml); playbook files whose `metadata.path` matches:
beside the parent file, then under each directory of NOETL_PLAYBOOK_PATH (os.pathsep-separated,
searched recursively); last, a file beside the parent named by the path with .yaml or .yml added
(`setup/x`), as NoETL's loader tries file paths.

The folder scan reads only what it needs: a file whose bytes do not contain the name looked for
is not parsed, and every file is read as a playbook is (at most NOETL_MAX_PLAYBOOK_BYTES, YAML
within NOETL_MAX_INPUT_DEPTH and NOETL_MAX_YAML_NODES), so no file of the folder can break the
compilation of a playbook beside it. A file's metadata.path is read once per (file, mtime) per
process.
"""

from __future__ import annotations

import difflib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from noetl_celery.config import limits
from noetl_celery.config import settings as noetl_settings
from noetl_celery.core.errors import PlaybookError
from noetl_celery.dsl import read_playbook_text
from noetl_celery.dsl.yaml_lines import load_yaml

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


def metadata_path(file: Path, containing: str | None = None) -> str | None:
    """The file's `metadata.path`, None when it has none or cannot be read as a playbook.
    `containing`: skip (None) a file whose bytes do not contain this text, without parsing it."""
    try:
        stat = file.stat()
    except OSError:
        return None
    key = (str(file), stat.st_mtime)
    if key in _metadata_paths:
        return _metadata_paths[key]
    if containing is not None and not _contains(file, containing.encode("utf-8")):
        return None
    _metadata_paths[key] = _read_metadata_path(file) if stat.st_size <= limits.max_playbook_bytes() else None
    return _metadata_paths[key]


def _contains(file: Path, needle: bytes) -> bool:
    try:
        with file.open("rb") as handle:
            return needle in handle.read(limits.max_playbook_bytes() + 1)
    except OSError:
        return False


def _read_metadata_path(file: Path) -> str | None:
    try:
        document, _ = load_yaml(read_playbook_text(file, str(file)), str(file))
    except PlaybookError:
        return None
    meta = document.get("metadata") if isinstance(document, dict) else None
    value = meta.get("path") if isinstance(meta, dict) else None
    return value if isinstance(value, str) else None


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
    return next(
        (file for _, file in playbook_files(parent_file) if metadata_path(file, catalog_path) == catalog_path), None
    )


def written_as_file(name: str) -> bool:
    """`./child.yaml`, `../x`, `setup/x.yaml`: a name that can only be a file path."""
    return name.startswith(("./", "../")) or name.endswith(PLAYBOOK_SUFFIXES)


def beside_parent(name: str, parent_file: str | None) -> Path | None:
    """The playbook file `name` names relative to the parent file's folder, as written or with
    .yaml or .yml added, if there is one."""
    if not parent_file or parent_file.startswith("catalog:") or Path(name).is_absolute():
        return None
    folder = Path(parent_file).resolve().parent
    names = [name] if name.endswith(PLAYBOOK_SUFFIXES) else [name + suffix for suffix in PLAYBOOK_SUFFIXES]
    return next((folder / candidate for candidate in names if (folder / candidate).is_file()), None)


def find(catalog_path: str, parent_file: str | None, catalog: Catalog | None = None) -> Found | None:
    """The sub-playbook `catalog_path` names (see the module docstring for the order). Raises
    PlaybookError when the file it names cannot be read as a playbook (too big, not UTF-8)."""
    if catalog is not None:
        found = catalog(catalog_path)
        if found is not None:
            return found
    file = beside_parent(catalog_path, parent_file) if written_as_file(catalog_path) else None
    if file is None:
        file = find_file(catalog_path, parent_file)
    if file is None and not written_as_file(catalog_path):
        file = beside_parent(catalog_path, parent_file)
    if file is None:
        return None
    return Found(path=catalog_path, source=str(file), text=read_playbook_text(file, str(file)))


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
