"""Splitting PostgreSQL text into statements (noetl_celery/tools/sql_text.py)."""

from __future__ import annotations

import pytest

from noetl_celery.tools.sql_text import split_statements


@pytest.mark.parametrize(
    ("text", "statements"),
    [
        ("SELECT 1", ["SELECT 1"]),
        ("SELECT 1; SELECT 2;", ["SELECT 1", "SELECT 2"]),
        ("SELECT 'a;b'; SELECT 'it''s;'", ["SELECT 'a;b'", "SELECT 'it''s;'"]),
        ("SELECT E'x\\';y'; SELECT 2", ["SELECT E'x\\';y'", "SELECT 2"]),
        ("SELECT e'\\\\'; SELECT 3", ["SELECT e'\\\\'", "SELECT 3"]),
        ("SELECT name' ;'", ["SELECT name' ;'"]),  # no E prefix: a backslash would not escape here
        ('SELECT "a;""b"; SELECT 3', ['SELECT "a;""b"', "SELECT 3"]),
        ("DO $$ BEGIN PERFORM 1; END $$; SELECT 4", ["DO $$ BEGIN PERFORM 1; END $$", "SELECT 4"]),
        (
            "CREATE FUNCTION f() RETURNS int AS $body$ SELECT 1; $$; $body$ LANGUAGE sql; SELECT f()",
            ["CREATE FUNCTION f() RETURNS int AS $body$ SELECT 1; $$; $body$ LANGUAGE sql", "SELECT f()"],
        ),
        (
            "-- c; x\nSELECT 5; /* a; /* b; */ c; */ SELECT 6; ;; /* x /* y */ z */ ; -- tail;",
            ["-- c; x\nSELECT 5", "/* a; /* b; */ c; */ SELECT 6"],
        ),
        ("SELECT a$b$ FROM t; SELECT $1; SELECT 7", ["SELECT a$b$ FROM t", "SELECT $1", "SELECT 7"]),
        ("SELECT 'unterminated; SELECT 8", ["SELECT 'unterminated; SELECT 8"]),
        ("SELECT $x$ never closed; SELECT 9", ["SELECT $x$ never closed; SELECT 9"]),
        ("  ;\n -- only\n /* comments */ ; ", []),
    ],
)
def test_split_statements(text: str, statements: list[str]) -> None:
    assert split_statements(text) == statements
