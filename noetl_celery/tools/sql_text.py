"""Split PostgreSQL text into its statements, as psql does before sending each one.

A `;` ends a statement except inside a string ('...', E'...' with backslash escapes), a quoted
identifier ("..."), a dollar-quoted body ($$...$$, $tag$...$tag$: `DO` blocks and function
bodies), a `--` comment or a `/* ... */` comment (nested, as PostgreSQL nests them). Statements
that hold nothing but whitespace and comments are dropped. The text of each statement is kept
as written (comments included, the `;` left off), so an error position still reads naturally.

An unterminated string, identifier, comment or dollar quote runs to the end of the text: the
server then reports the error on that statement, as it would for the whole text.

`placeholders` finds PostgreSQL's positional parameters (`$1`, `$2`, ...) the same way: a `$N`
inside a string, a quoted identifier, a dollar-quoted body or a comment is not one, nor is a `$`
that is part of an identifier (`a$1`).
"""

from __future__ import annotations

import re

# The next character that can open something a `;` must not end, or the `;` itself.
_SPECIAL = re.compile(r"""[;'"$]|--|/\*""")
_DOLLAR_TAG = re.compile(r"\$(?:[A-Za-z_\x80-\U0010ffff][A-Za-z_0-9\x80-\U0010ffff]*)?\$")
_IDENT_CHAR = re.compile(r"[A-Za-z_0-9$\x80-\U0010ffff]")
_E_STRING_END = re.compile(r"(?:[^'\\]|\\.|'')*'", re.DOTALL)
_COMMENT_MARK = re.compile(r"/\*|\*/")
_SPACE = re.compile(r"\s*")
_PARAMETER = re.compile(r"\$([0-9]+)")


def _scan(text: str) -> list[tuple[str, int, int]]:
    """(token, start, end) of each `;` and `$N` outside strings, quoted identifiers, dollar
    quotes and comments, in order."""
    found: list[tuple[str, int, int]] = []
    pos, end = 0, len(text)
    while pos < end:
        match = _SPECIAL.search(text, pos)
        if match is None:
            break
        token, at = match.group(), match.start()
        if token == ";":
            found.append((";", at, at + 1))
            pos = at + 1
        elif token == "'":
            pos = _after_string(text, at)
        elif token == '"':
            close = text.find('"', at + 1)
            while close != -1 and text.startswith('"', close + 1):  # "" inside an identifier
                close = text.find('"', close + 2)
            pos = end if close == -1 else close + 1
        elif token == "--":
            newline = text.find("\n", at)
            pos = end if newline == -1 else newline + 1
        elif token == "/*":
            pos = _after_block_comment(text, at)
        elif at > 0 and _IDENT_CHAR.match(text, at - 1):  # "$" inside an identifier (a$b)
            pos = at + 1
        elif (parameter := _PARAMETER.match(text, at)) is not None:
            found.append(("$", at, parameter.end()))
            pos = parameter.end()
        elif (tag := _DOLLAR_TAG.match(text, at)) is not None:
            close = text.find(tag.group(), tag.end())
            pos = end if close == -1 else close + len(tag.group())
        else:
            pos = at + 1
    return found


def placeholders(text: str) -> list[tuple[int, int, int]]:
    """(number, start, end) of each positional parameter `$N` of `text`, in order."""
    return [(int(text[start + 1 : stop]), start, stop) for token, start, stop in _scan(text) if token == "$"]


def split_statements(text: str) -> list[str]:
    """The statements of `text`, in order, without their terminating `;`."""
    statements: list[str] = []
    start = 0
    for token, at, stop in _scan(text):
        if token == ";":
            _keep(statements, text[start:at])
            start = stop
    _keep(statements, text[start:])
    return statements


def _keep(statements: list[str], statement: str) -> None:
    """Append `statement` unless it is only whitespace and comments."""
    pos, end = 0, len(statement)
    while True:
        pos = _SPACE.match(statement, pos).end()  # type: ignore[union-attr]  # \s* always matches
        if statement.startswith("--", pos):
            newline = statement.find("\n", pos)
            pos = end if newline == -1 else newline + 1
        elif statement.startswith("/*", pos):
            pos = _after_block_comment(statement, pos)
        else:
            break
    if pos < end:
        statements.append(statement.strip())


def _after_string(text: str, at: int) -> int:
    """The position after the string literal opening at `at` (a `'`)."""
    escaped = at > 0 and text[at - 1] in "eE" and not (at > 1 and _IDENT_CHAR.match(text, at - 2))
    if escaped:
        match = _E_STRING_END.match(text, at + 1)
        return len(text) if match is None else match.end()
    pos = at + 1
    while True:
        close = text.find("'", pos)
        if close == -1:
            return len(text)
        if not text.startswith("'", close + 1):
            return close + 1
        pos = close + 2  # '' is a quote inside the string


def _after_block_comment(text: str, at: int) -> int:
    """The position after the (possibly nested) comment opening at `at`."""
    depth, pos = 0, at
    for mark in _COMMENT_MARK.finditer(text, at):
        depth += 1 if mark.group() == "/*" else -1
        pos = mark.end()
        if depth == 0:
            return pos
    return len(text)
