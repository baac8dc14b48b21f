"""YAML loading that remembers where every key and list item was written.

Decides: how a playbook's text becomes Python values (`LDict` / `LList`, which are a dict and a
list that also know the 1-based line of each key and item), that a duplicate key is a problem,
that mapping keys stay the text they were written as (`on:` is the key "on", not True) and that
timestamps stay strings (a plan must be JSON-serialisable). It must not interpret the playbook.
"""

from __future__ import annotations

from typing import Any

import yaml
from yaml.nodes import MappingNode, Node, ScalarNode, SequenceNode

from noetl_celery.errors import Problem

MAX_DEPTH = 200  # nesting levels; deeper documents (or alias cycles) are rejected


class LDict(dict):  # type: ignore[type-arg]
    """A mapping that knows its own line and the line of each of its keys."""

    line: int | None = None

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.key_lines: dict[str, int] = {}

    def line_of(self, key: str) -> int | None:
        return self.key_lines.get(key, self.line)


class LList(list):  # type: ignore[type-arg]
    """A sequence that knows its own line and the line of each item."""

    line: int | None = None

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self.item_lines: list[int] = []

    def line_of(self, index: int) -> int | None:
        return self.item_lines[index] if 0 <= index < len(self.item_lines) else self.line


def line_of(container: Any, key: str | int) -> int | None:
    """Line of `key` (a mapping key or a list index) in `container`, if it was loaded with lines."""
    if isinstance(container, LDict) and isinstance(key, str):
        return container.line_of(key)
    if isinstance(container, LList) and isinstance(key, int):
        return container.line_of(key)
    return getattr(container, "line", None)


def plain(value: Any) -> Any:
    """The same value with every LDict/LList turned into a plain dict/list."""
    if isinstance(value, dict):
        return {str(k): plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [plain(v) for v in value]
    return value


class _Loader(yaml.SafeLoader):
    """SafeLoader without the timestamp resolver (dates stay strings)."""


_Loader.yaml_implicit_resolvers = {
    first: [(tag, regexp) for tag, regexp in resolvers if tag != "tag:yaml.org,2002:timestamp"]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
}


def _line(node: Node) -> int:
    return node.start_mark.line + 1


def _step_label(node: MappingNode) -> str:
    for key, value in node.value:
        if isinstance(key, ScalarNode) and key.value == "step" and isinstance(value, ScalarNode):
            return f"({value.value})"
    return ""


class _Builder:
    """Walks the composed node tree, building LDict/LList values and noting duplicate keys."""

    def __init__(self, loader: _Loader, file: str):
        self.loader = loader
        self.file = file
        self.problems: list[Problem] = []

    def build(self, node: Node, path: str, depth: int = 0) -> Any:
        if depth > MAX_DEPTH:
            self.problems.append(Problem(self.file, _line(node), path, "document nested too deeply"))
            return None
        if isinstance(node, MappingNode):
            return self._mapping(node, path, depth)
        if isinstance(node, SequenceNode):
            return self._sequence(node, path, depth)
        return self.loader.construct_object(node, deep=True)

    def _mapping(self, node: MappingNode, path: str, depth: int) -> LDict:
        self.loader.flatten_mapping(node)  # resolves `<<` merge keys
        result = LDict()
        result.line = _line(node)
        for key_node, value_node in node.value:
            if not isinstance(key_node, ScalarNode):
                self.problems.append(
                    Problem(self.file, _line(key_node), path, "a mapping key must be a scalar")
                )
                continue
            key = str(key_node.value)
            key_path = f"{path}.{key}" if path else key
            if key in result.key_lines:
                first = result.key_lines[key]
                message = f"duplicate key '{key}' (first given at line {first})"
                self.problems.append(Problem(self.file, _line(key_node), key_path, message))
                continue
            result.key_lines[key] = _line(key_node)
            result[key] = self.build(value_node, key_path, depth + 1)
        return result

    def _sequence(self, node: SequenceNode, path: str, depth: int) -> LList:
        result = LList()
        result.line = _line(node)
        for index, item in enumerate(node.value):
            label = _step_label(item) if path == "workflow" and isinstance(item, MappingNode) else ""
            result.append(self.build(item, f"{path}[{index}]{label}", depth + 1))
            result.item_lines.append(_line(item))
        return result


def load_yaml(text: str, file: str) -> tuple[Any, list[Problem]]:
    """Parse one YAML document. Returns (value, problems); value is None when it did not parse."""
    loader = _Loader(text)
    try:
        node = loader.get_single_node()
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        line = mark.line + 1 if mark is not None else None
        reason = " ".join(part for part in (exc.context, exc.problem) if part)
        return None, [Problem(file, line, "", f"invalid YAML: {reason}")]
    except yaml.YAMLError as exc:
        return None, [Problem(file, None, "", f"invalid YAML: {exc}")]
    finally:
        loader.dispose()
    if node is None:
        return None, [Problem(file, None, "", "the document is empty")]
    builder = _Builder(loader, file)
    try:
        value = builder.build(node, "")
    except yaml.MarkedYAMLError as exc:  # a scalar that does not construct (bad !!int, ...)
        mark = exc.problem_mark or exc.context_mark
        return None, [Problem(file, mark.line + 1 if mark else None, "", f"invalid YAML: {exc.problem}")]
    return value, builder.problems
