"""YAML loading that remembers where every key and list item was written.

Decides: how a playbook's text becomes Python values (`LDict` / `LList`, which are a dict and a
list that also know the 1-based line of each key and item), that a duplicate key is a problem,
that mapping keys stay the text they were written as (`on:` is the key "on", not True) and that
timestamps stay strings (a plan must be JSON-serialisable). It must not interpret the playbook.
"""

from __future__ import annotations

from functools import partial
from typing import Any

import yaml
from yaml.nodes import MappingNode, Node, ScalarNode, SequenceNode

from noetl_celery.config import limits
from noetl_celery.core.errors import Problem
from noetl_celery.core.jsonable import plain as _plain


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


plain = partial(_plain, str_keys=True)  # every LDict/LList as a plain dict/list, keys as text


class TooDeep(Exception):
    """A YAML document nests deeper than NOETL_MAX_INPUT_DEPTH (raised while composing)."""

    def __init__(self, node_mark: Any, limit: int):
        super().__init__(limit)
        self.mark = node_mark
        self.limit = limit


class _Loader(yaml.SafeLoader):
    """SafeLoader without the timestamp resolver (dates stay strings), that refuses a document
    nested deeper than NOETL_MAX_INPUT_DEPTH before the recursive composer could overflow."""

    def __init__(self, stream: str) -> None:
        super().__init__(stream)
        self.depth = 0
        self.max_depth = limits.max_input_depth()

    def compose_node(self, parent: Node | None, index: Any) -> Node | None:  # type: ignore[override]
        self.depth += 1
        try:
            if self.depth > self.max_depth:
                raise TooDeep(self.peek_event().start_mark, self.max_depth)
            return super().compose_node(parent, index)  # type: ignore[no-any-return]
        finally:
            self.depth -= 1


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
        self.max_depth = limits.max_input_depth()  # aliases can nest a document deeper than its text

    def build(self, node: Node, path: str, depth: int = 0) -> Any:
        if depth > self.max_depth:
            self.problems.append(too_deep_problem(self.file, _line(node), self.max_depth))
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
                message = "a mapping key must be a scalar"
                if isinstance(key_node, MappingNode) and node.flow_style:
                    message += " (a template value '{{ ... }}' must be quoted)"
                self.problems.append(Problem(self.file, _line(key_node), path, message))
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


def _source_line(text: str, line: int | None) -> str:
    lines = text.splitlines()
    return lines[line - 1].strip() if line is not None and 0 < line <= len(lines) else ""


def _line_of_mark(mark: Any) -> int | None:
    return mark.line + 1 if mark is not None else None


def explain_yaml_error(exc: yaml.MarkedYAMLError, text: str) -> tuple[int | None, str]:
    """A YAML syntax error in our words, at the line where the mistake is (the parser notices
    some mistakes only on the line after them)."""
    problem, context = exc.problem or "", exc.context or ""
    problem_line, context_line = _line_of_mark(exc.problem_mark), _line_of_mark(exc.context_mark)
    if "could not find expected ':'" in problem and "simple key" in context:
        shown = _source_line(text, context_line)
        return context_line, (
            f"invalid YAML: '{shown}' is not `key: value` (a key needs ': ' after it) nor a list item ('- ...')"
        )
    if "mapping values are not allowed" in problem:
        shown = _source_line(text, problem_line)
        return problem_line, (
            f"invalid YAML: indentation: '{shown}' is indented deeper than the key above it, "
            "so it reads as part of that key's value; align it with the keys beside it "
            "(or quote a value that contains ': ')"
        )
    if "expected <block end>" in problem:
        shown = _source_line(text, problem_line)
        return problem_line, (
            f"invalid YAML: indentation: '{shown}' does not line up with the block that "
            f"starts at line {context_line}; indent it like the other entries of that block"
        )
    if "'\\t'" in problem:  # the parser writes the tab as \t
        return problem_line, "invalid YAML: indentation: a tab character; YAML indents with spaces only"
    if "flow sequence" in context or "flow mapping" in context:
        bracket = "[" if "sequence" in context else "{"
        hint = " (a template '{{ ... }}' included)" if bracket == "{" else ""
        return context_line, (
            f"invalid YAML: the '{bracket}' opened at line {context_line} is not closed "
            f"where expected ({problem}); quote a value that starts with '{bracket}'{hint}"
        )
    if "quoted scalar" in context:
        return context_line, f"invalid YAML: the quoted string that starts at line {context_line} is not closed"
    reason = " ".join(part for part in (context, problem) if part)
    return problem_line or context_line, f"invalid YAML: {reason}"


def _oversized(root: Node, limit: int) -> Node | None:
    """The first node whose value, with every alias expanded, holds more than `limit` nodes (or
    that contains itself); None when the document is within the limit. Linear in the distinct
    nodes: each node's expanded size is counted once."""
    sizes: dict[int, int] = {}
    in_progress: set[int] = set()
    stack: list[tuple[Node, bool]] = [(root, False)]
    while stack:
        node, children_done = stack.pop()
        key = id(node)
        if key in sizes:
            continue
        children = _children(node)
        if not children_done:
            if key in in_progress:
                return node  # an alias inside its own anchor
            in_progress.add(key)
            stack.append((node, True))
            for child in children:
                if id(child) in in_progress and id(child) not in sizes:
                    return child
                if id(child) not in sizes:
                    stack.append((child, False))
            continue
        in_progress.discard(key)
        size = 1 + sum(sizes[id(child)] for child in children)
        if size > limit:
            return node
        sizes[key] = size
    return None


def _children(node: Node) -> list[Node]:
    if isinstance(node, MappingNode):
        return [part for pair in node.value for part in pair]
    if isinstance(node, SequenceNode):
        return list(node.value)
    return []


def oversized_problem(file: str, node: Node) -> Problem:
    limit = limits.max_yaml_nodes()
    return Problem(
        file,
        _line(node),
        "",
        f"YAML expands to more than {limit} nodes here (aliases of aliases?); refused (NOETL_MAX_YAML_NODES)",
    )


def too_deep_problem(file: str, line: int | None, limit: int) -> Problem:
    return Problem(
        file, line, "", f"the document nests more than {limit} levels deep here; refused (NOETL_MAX_INPUT_DEPTH)"
    )


def _unreadable_character(file: str, text: str, exc: yaml.reader.ReaderError) -> Problem:
    """A character YAML does not allow in a document (NUL, other control characters)."""
    position = max(0, min(exc.position, len(text)))
    line = text.count("\n", 0, position) + 1
    column = position - (text.rfind("\n", 0, position) + 1) + 1
    code = exc.character if isinstance(exc.character, int) else ord(str(exc.character)[:1] or "\0")
    return Problem(
        file,
        line,
        "",
        f"invalid YAML: character U+{code:04X} at column {column} is not allowed in a YAML document; "
        f'remove it (inside a double-quoted string write it as "\\x{code:02x}")',
    )


def load_yaml(text: str, file: str) -> tuple[Any, list[Problem]]:
    """Parse one YAML document. Returns (value, problems); value is None when it did not parse."""
    loader = None
    try:
        loader = _Loader(text)
        node = loader.get_single_node()
    except yaml.MarkedYAMLError as exc:
        line, message = explain_yaml_error(exc, text)
        return None, [Problem(file, line, "", message)]
    except yaml.reader.ReaderError as exc:
        return None, [_unreadable_character(file, text, exc)]
    except yaml.YAMLError as exc:
        return None, [Problem(file, None, "", f"invalid YAML: {exc}")]
    except TooDeep as exc:
        return None, [too_deep_problem(file, _line_of_mark(exc.mark), exc.limit)]
    except RecursionError:  # a stack already deep when parsing began
        return None, [too_deep_problem(file, None, limits.max_input_depth())]
    finally:
        if loader is not None:
            loader.dispose()
    if node is None:
        return None, [Problem(file, None, "", "the document is empty")]
    oversized = _oversized(node, limits.max_yaml_nodes())
    if oversized is not None:
        return None, [oversized_problem(file, oversized)]
    builder = _Builder(loader, file)
    try:
        value = builder.build(node, "")
    except yaml.MarkedYAMLError as exc:  # a scalar that does not construct (bad !!int, ...)
        mark = exc.problem_mark or exc.context_mark
        return None, [Problem(file, mark.line + 1 if mark else None, "", f"invalid YAML: {exc.problem}")]
    return value, builder.problems
