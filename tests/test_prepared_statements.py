"""Prepared statements of the hot path (store/prepared.py): a text sent twice on one connection
is prepared and then executed by name; a failed batch leaves no name the session cannot account
for; a statement the server will not prepare is sent as text; a pooler in front of the server is
seen (auto) or found out (on), and nothing is prepared through it."""

from __future__ import annotations

import pytest
from sqlalchemy.exc import DBAPIError

from noetl_celery.config import settings as noetl_settings
from noetl_celery.store import db, prepared, repo
from tests.support import pgbouncer as bouncers

SUM = "SELECT %s::int + %s"


def test_a_text_is_prepared_on_its_second_send_and_executed_by_name_after():
    session = prepared.Session()
    sql = "UPDATE t SET a = a + %s WHERE b LIKE '%%s' AND c = %s RETURNING a; COMMIT"
    assert session.rewrite(sql, (1, 2)) == (sql, (1, 2))
    session.succeeded()
    second, params = session.rewrite(sql, (1, 2))
    [name] = session.names.values()
    assert second == (
        f"PREPARE {name} AS UPDATE t SET a = a + $1 WHERE b LIKE '%%s' AND c = $2 RETURNING a; "
        f"EXECUTE {name}(%s, %s); COMMIT"
    )
    assert params == (1, 2)
    session.succeeded()
    assert session.rewrite(sql, (3, 4)) == (f"EXECUTE {name}(%s, %s); COMMIT", (3, 4))


def test_texts_whose_placeholders_do_not_match_their_parameters_are_sent_as_they_are():
    session = prepared.Session()
    for _ in range(3):
        assert session.rewrite("SELECT %s, %s", (1,)) == ("SELECT %s, %s", (1,))
        assert session.rewrite("SELECT %(a)s", {"a": 1}) == ("SELECT %(a)s", {"a": 1})
        assert session.rewrite("COMMIT", ()) == ("COMMIT", ())
    assert not session.names


def test_the_least_recently_used_statement_is_deallocated_in_front_of_the_next_batch(monkeypatch):
    monkeypatch.setattr(prepared, "MAX_PREPARED", 2)
    session = prepared.Session()
    texts = [f"SELECT %s + {n}" for n in range(3)]
    for text in texts[:2] * 2:
        session.rewrite(text, (1,))
        session.succeeded()
    first = session.names[texts[0]]
    session.rewrite(texts[0], (1,))  # used: the second is now the least recent
    session.succeeded()
    second = session.names[texts[1]]
    session.rewrite(texts[2], (1,))
    session.succeeded()
    batch, _ = session.rewrite(texts[2], (1,))
    assert batch.startswith(f"DEALLOCATE {second}; PREPARE ")
    assert set(session.names) == {texts[0], texts[2]} and session.names[texts[0]] == first


def test_a_failed_batch_that_prepared_is_followed_by_deallocate_all():
    session = prepared.Session()
    session.rewrite(SUM, (1, 2))
    session.succeeded()
    session.rewrite(SUM, (1, 2))  # prepares
    session.failed()
    assert not session.names
    batch, _ = session.rewrite(SUM, (1, 2))
    assert batch.startswith("DEALLOCATE ALL; PREPARE ")
    session.succeeded()
    assert session.rewrite(SUM, (1, 2))[0].startswith("EXECUTE ")


def _server_names(conn) -> set[str]:
    return {
        row[0]
        for row in conn.exec_driver_sql("SELECT name FROM pg_prepared_statements WHERE name LIKE 'noetl%%'").fetchall()
    }


@pytest.fixture
def direct_url(migrated_postgres, monkeypatch):
    monkeypatch.delenv(noetl_settings.PG_PREPARE_ENV, raising=False)
    yield migrated_postgres.url
    db.dispose_engine(migrated_postgres.url)


@pytest.mark.services
def test_statements_run_prepared_on_a_direct_connection_with_the_same_results(direct_url):
    engine = db.get_engine(direct_url)
    with db._autocommit(engine) as (conn, _):
        session = prepared.session_of(conn.connection.info, engine)
        assert session is not None  # auto: 127.0.0.1 and the server's own port
        results = [repo._run(conn, SUM, (n, 2)).fetchone()[0] for n in range(4)]
        assert results == [2, 3, 4, 5]
        assert _server_names(conn) == set(session.names.values()) and len(session.names) == 1


@pytest.mark.services
def test_a_failed_batch_leaves_the_server_with_only_the_statements_the_session_knows(direct_url):
    engine = db.get_engine(direct_url)
    insert = "INSERT INTO noetl_variable (execution_id, scope, name, value, updated_at) VALUES (%s, %s, %s, %s, now())"
    with db._autocommit(engine) as (conn, _):
        session = prepared.session_of(conn.connection.info, engine)
        assert session is not None
        repo._run(conn, insert, (1, "ctx", "a", "1"))
        with pytest.raises(DBAPIError) as failed:  # its second send prepares, then hits the key
            repo._run(conn, insert, (1, "ctx", "a", "1"))
        assert failed.value.orig.pgcode == "23505"  # the statement's own error: raised as it is
        assert session.reset and not session.names and insert not in session.plain
        repo._run(conn, insert, (1, "ctx", "b", "2"))  # DEALLOCATE ALL in front, prepared again
        repo._run(conn, insert, (1, "ctx", "c", "3"))
        assert _server_names(conn) == set(session.names.values()) and len(session.names) == 1
        names = [r[0] for r in conn.exec_driver_sql("SELECT name FROM noetl_variable ORDER BY name").fetchall()]
        assert names == ["a", "b", "c"]


@pytest.mark.services
def test_a_statement_the_server_will_not_prepare_is_sent_as_text(direct_url):
    engine = db.get_engine(direct_url)
    listed = "SELECT count(*) FROM noetl_event WHERE event_type IN %s"  # a tuple: `IN $1` is no syntax
    with db._autocommit(engine) as (conn, _):
        session = prepared.session_of(conn.connection.info, engine)
        assert session is not None
        counts = [repo._run(conn, listed, (("a", "b"),)).fetchone()[0] for _ in range(3)]
        assert counts == [0, 0, 0]
        assert listed in session.plain and not session.names and not _server_names(conn)


@pytest.mark.services
@pytest.mark.skipif(bouncers.available() is None, reason="pgbouncer is not installed (apt-get install pgbouncer)")
def test_auto_prepares_nothing_through_pgbouncer_and_on_finds_it_out(migrated_postgres, monkeypatch):
    with bouncers.pgbouncer(migrated_postgres.url, pool_size=1) as bouncer:
        url = bouncer.url(migrated_postgres.url)
        monkeypatch.delenv(noetl_settings.PG_PREPARE_ENV, raising=False)
        engine = db.get_engine(url)
        try:
            with db._autocommit(engine) as (conn, _):
                assert conn.connection.info.get(prepared.KEY) is None  # the server's port is not the URL's
                assert [repo._run(conn, SUM, (n, 1)).fetchone()[0] for n in range(3)] == [1, 2, 3]
        finally:
            db.dispose_engine(url)

        monkeypatch.setenv(noetl_settings.PG_PREPARE_ENV, "on")
        url = bouncer.url(migrated_postgres.url) + "?application_name=prepare_on"  # an engine of its own
        engine = db.get_engine(url)
        try:
            with db._autocommit(engine) as (one, _), db._autocommit(engine) as (other, _):
                assert prepared.session_of(one.connection.info, engine) is not None
                for n in range(2):  # prepared on the pool's one server connection
                    assert repo._run(one, SUM, (n, 1)).fetchone()[0] == n + 1
                repo._run(other, SUM, (0, 1))
                with pytest.raises(DBAPIError) as refused:  # the same name, prepared there already
                    repo._run(other, SUM, (0, 1))
                assert prepared.pooler_error(refused.value.orig)
                assert prepared.session_of(other.connection.info, engine) is None
                assert repo._run(other, SUM, (5, 1)).fetchone()[0] == 6  # as text from now on
                assert repo._run(one, SUM, (7, 1)).fetchone()[0] == 8
        finally:
            db.dispose_engine(url)


@pytest.mark.services
def test_in_a_transaction_already_open_a_refused_preparation_is_raised_and_the_text_stays_plain(direct_url):
    listed = "SELECT count(*) FROM noetl_execution WHERE status IN %s"
    engine = db.get_engine(direct_url)
    with db._autocommit(engine) as (conn, _):
        session = prepared.session_of(conn.connection.info, engine)
        assert session is not None
        assert repo._run(conn, listed, (("running",),)).fetchone()[0] == 0  # sent once: as text
    with pytest.raises(DBAPIError) as refused, db.decision_transaction(direct_url) as conn:
        repo._run(conn, SUM, (1, 1))  # opens the transaction
        repo._run(conn, listed, (("running",),))  # its second send: prepared, refused
    assert refused.value.orig.pgcode.startswith("42")
    with db.decision_transaction(direct_url) as conn:
        again = prepared.session_of(conn.connection.info, engine)
        assert again is session and listed in session.plain
        assert repo._run(conn, listed, (("running",),)).fetchone()[0] == 0
