"""Names a template may use, and the `{{ name }}` that can never exist in a playbook.

Templates render leniently at run time (templates.render.lenient): a name that is not there reads as
empty. That must not hide a typo for good, so validate reports each name a template uses that no
part of the playbook could ever give: it is no step, task label, workbook entry, workload or
ctx key, vars/set/iter name, loop iterator, argument name, keychain entry or built-in name
anywhere in the playbook, nor set by the template itself (`{% set %}`, `{% for %}`). The check
is generous on purpose (a name given anywhere counts everywhere), so that it only reports what
is certainly a mistake, with the nearest known name.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

from jinja2 import meta
from jinja2.exceptions import TemplateError as JinjaError

from noetl_celery.dsl.validate import NON_TEMPLATE_KEYS, Context, join, step_path, suggest
from noetl_celery.dsl.yaml_lines import line_of
from noetl_celery.templates.render import BUILTIN_NAMES, ENV, jinja_source

# Names the engine or NoETL's renderer gives beside BUILTIN_NAMES and Jinja's globals.
ENGINE_NAMES = frozenset(
    {
        "loop_results",  # a loop's results, in the args and ctx of the step it routes to
        "index",  # a loop's iteration index in legacy templates
        "item",  # a legacy loop's element
        "input_data",
        "context",
        "env",
        "keychain",
        "secret",
        "secrets",
        "payload",
        "page",
        "pages",
        "results",
        "stats",
        "true",
        "false",
        "none",
        "True",
        "False",
        "None",
    }
)
ENGINE_PREFIX = "__"  # names the engine binds for its own use (a cursor claim's `__frame_max_rows`)
# Keys whose mapping's keys become names (assignments, arguments, iterators)
NAMING_BLOCKS = frozenset(
    {
        "workload",
        "ctx",
        "vars",
        "set",
        "set_ctx",
        "set_vars",
        "set_iter",
        "args",
        "input",
        "with",
        "payload",
        "keychain",
        "data",
        "params",
    }
)
# Keys whose string value is a name
NAMING_VALUES = frozenset({"step", "name", "iterator", "element", "as", "into", "task", "label", "alias"})


def _walk(value: Any, path: str = "") -> Iterator[tuple[Any, str | int, Any, str]]:
    """(holder, key, value, path) of every entry of the document, depth first."""
    if isinstance(value, dict):
        for key, item in value.items():
            item_path = join(path, key)
            yield value, key, item, item_path
            yield from _walk(item, item_path)
    elif isinstance(value, list):
        for index, item in enumerate(value):
            item_path = step_path(index, item) if path == "workflow" else join(path, index)
            yield value, index, item, item_path
            yield from _walk(item, item_path)


def known_names(document: Any) -> set[str]:
    """Every name the playbook gives anywhere (see the module docstring)."""
    names: set[str] = set(BUILTIN_NAMES) | ENGINE_NAMES | set(ENV.globals)
    for _holder, key, value, _path in _walk(document):
        if isinstance(key, str):
            if key in NAMING_BLOCKS and isinstance(value, dict):
                for name in value:
                    names.update(str(name).split("."))  # `ctx.x` and `x` alike
            if key in NAMING_VALUES and isinstance(value, str):
                names.add(value)
        if isinstance(value, dict) and key != "workload":
            # a pipeline task written `- label: {kind: ...}` is named by its key
            for name, body in value.items():
                if isinstance(body, dict) and ("kind" in body or "tool" in body):
                    names.add(str(name))
    return names


def _used(text: str) -> set[str]:
    try:
        return set(meta.find_undeclared_variables(ENV.parse(jinja_source(text))))
    except JinjaError:
        return set()  # a template that does not parse is reported by check_templates


def check_names(ctx: Context, document: Any, given: Iterable[str] = ()) -> None:
    """A problem for each name a template uses that the playbook never gives (with the nearest);
    `given`: names the caller adds (`--set` keys)."""
    if not isinstance(document, dict):
        return
    known = known_names(document) | set(given)
    reported: set[tuple[int | None, str]] = set()
    for holder, key, value, path in _walk(document):
        if not isinstance(value, str) or ("{{" not in value and "{%" not in value):
            continue
        if _inside_raw(path):
            continue
        line = line_of(holder, key)
        for name in sorted(name for name in _used(value) - known if not name.startswith(ENGINE_PREFIX)):
            if (line, name) in reported:
                continue
            reported.add((line, name))
            hint = suggest(name, known)
            ctx.problem(
                line,
                path,
                f"'{name}' in {value.strip()[:80]!r} is no step, task, workload, ctx, vars or built-in name "
                f"of this playbook{hint}",
            )


def _inside_raw(path: str) -> bool:
    """A string under a key that is never rendered (python `code`)."""
    return any(part.split("[")[0] in NON_TEMPLATE_KEYS for part in path.split("."))
