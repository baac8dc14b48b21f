"""The `nats` tool against the machine's NATS server (JetStream), on buckets of each test's own."""

from __future__ import annotations

import asyncio
import json
import os
import socket
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from noetl_celery.tools.base import Outcome, ToolCall, run_tool
from tests.support import services as svc
from tests.support.corpus import CORPUS
from tests.support.harness import run_playbook

NATS_URL = os.environ.get("NOETL_TEST_NATS_URL", "nats://127.0.0.1:4222")
CORPUS_FILE = CORPUS / "renames-2026-04" / "auth0_login_tags_credential_pool.yaml"


def _reachable(url: str) -> bool:
    host, _, port = url.split("://", 1)[1].rpartition("@")[2].partition(":")
    try:
        with socket.create_connection((host, int(port or 4222)), timeout=1):
            return True
    except OSError:
        return False


async def _with_js(fn: Any) -> Any:
    import nats

    nc = await nats.connect(NATS_URL)
    try:
        return await fn(nc.jetstream())
    finally:
        await nc.close()


@pytest.fixture
def bucket() -> Iterator[str]:
    """A key/value bucket of this test's own, deleted after it."""
    if not _reachable(NATS_URL):
        svc.unavailable(f"no NATS server at {NATS_URL}")
    name = f"noetl_test_{uuid.uuid4().hex[:12]}"

    async def create(js: Any) -> None:
        await js.create_key_value(bucket=name)

    async def delete(js: Any) -> None:
        await js.delete_key_value(name)

    asyncio.run(_with_js(create))
    yield name
    asyncio.run(_with_js(delete))


def nats(credential: Any = NATS_URL, **config: Any) -> Outcome:
    return run_tool(ToolCall(kind="nats", config=config, credential=credential, timeout=10))


def test_put_get_delete_and_a_missing_key(bucket: str) -> None:
    session = {"session_token": "abc", "roles": ["admin"], "user_id": 7}
    put = nats(operation="kv_put", bucket=bucket, key="s1", value=session)
    assert put.status == "ok", put.error
    assert put.data == {"status": "success", "bucket": bucket, "key": "s1", "revision": put.data["revision"]}
    assert put.data["revision"] >= 1

    got = nats(operation="kv_get", bucket=bucket, key="s1")
    assert got.status == "ok", got.error
    assert got.data["status"] == "success" and got.data["value"] == session  # JSON back as a mapping
    assert got.data["revision"] == put.data["revision"] and "created" in got.data

    assert nats(operation="kv_put", bucket=bucket, key="plain", value="not json").status == "ok"
    assert nats(operation="kv_get", bucket=bucket, key="plain").data["value"] == "not json"
    keys = nats(operation="kv_keys", bucket=bucket, pattern="s*")
    assert keys.data == {"status": "success", "bucket": bucket, "keys": ["s1"], "count": 1}

    deleted = nats(operation="kv_delete", bucket=bucket, key="s1")
    assert deleted.status == "ok" and deleted.data == {"status": "success", "bucket": bucket, "key": "s1"}
    gone = nats(operation="kv_get", bucket=bucket, key="s1")
    assert gone.status == "ok"
    assert gone.data == {"status": "not_found", "bucket": bucket, "key": "s1", "value": None}
    never = nats(operation="kv_get", bucket=bucket, key="never-written")
    assert never.data["status"] == "not_found"


def test_credential_mapping_with_user_fields_and_nats_url_in_the_task(bucket: str) -> None:
    out = nats(credential=None, nats_url=NATS_URL, operation="kv_put", bucket=bucket, key="k", value=3)
    assert out.status == "ok", out.error
    assert nats(credential={"nats_url": NATS_URL}, operation="kv_get", bucket=bucket, key="k").data["value"] == 3


def test_a_missing_bucket_is_a_clear_not_found_error(bucket: str) -> None:
    missing = f"{bucket}_absent"
    out = nats(operation="kv_put", bucket=missing, key="k", value="v")
    assert out.status == "error"
    assert out.error is not None and out.error["kind"] == "not_found" and not out.error["retryable"]
    assert f"key/value bucket '{missing}' does not exist on nats://127.0.0.1:4222" in out.error["message"]


def test_an_unreachable_server_is_a_retryable_connection_error_without_the_password() -> None:
    port = svc.free_port()
    url = f"nats://app:hunter2-secret@127.0.0.1:{port}"
    out = nats(credential={"url": url}, operation="kv_get", bucket="b", key="k")
    assert out.status == "error" and out.error is not None
    assert out.error["kind"] == "connection" and out.error["retryable"]
    assert out.error["message"] == f"nats: cannot reach a NATS server at nats://127.0.0.1:{port}"
    assert "hunter2" not in json.dumps(out.to_dict())


def test_bad_arguments_are_named() -> None:
    out = nats(credential=None, operation="kv_put", bucket="b")  # checked before the server is needed
    assert out.error is not None and out.error["message"] == "nats: kv_put needs `key`, `value`"
    out = nats(credential=None, operation="kv_get", bucket="b", key="k")
    assert out.error == {
        "kind": "invalid_args",
        "message": "nats: no server: name a credential with a `url` in `auth:` or give `nats_url:` in the task",
        "retryable": False,
    }
    out = nats(operation="object_get", bucket="b")
    assert out.error is not None and "operation must be one of kv_put" in out.error["message"]


AUTH_SCHEMA = """
CREATE SCHEMA auth;
CREATE TABLE auth.users (user_id serial PRIMARY KEY, auth0_id text UNIQUE, email text,
    display_name text, last_login_at timestamptz, is_active boolean DEFAULT true);
CREATE TABLE auth.sessions (user_id int, session_token text, auth0_token text,
    expires_at timestamptz, ip_address inet);
CREATE TABLE auth.roles (role_id serial PRIMARY KEY, role_name text);
CREATE TABLE auth.user_roles (user_id int, role_id int, expires_at timestamptz);
"""


@pytest.mark.skipif(not CORPUS_FILE.is_file(), reason="the NoETL corpus is not here")
def test_the_corpus_login_playbook_caches_its_session_in_nats(bucket: str, fresh_postgres: Any, tmp_path: Path) -> None:
    """NoETL's auth0_login (corpus) end to end: JWT decode, the session in PostgreSQL, the
    session cached in the NATS bucket by its `kind: nats` step, named by an `auth:` credential
    that carries a token; the token is masked in the status."""
    import base64

    import psycopg2

    with psycopg2.connect(fresh_postgres.dsn) as conn, conn.cursor() as cur:
        cur.execute(AUTH_SCHEMA)
    conn.close()
    claims = {"sub": "auth0|42", "email": "ada@example.com", "name": "Ada"}
    payload = base64.urlsafe_b64encode(json.dumps(claims).encode()).decode().rstrip("=")
    token = f"eyJhbGciOiJub25lIn0.{payload}.sig"
    nats_token = "nats-token-7f3a9c21"  # the local server has no auth: a token is accepted and unused
    env = {
        "NOETL_HOME": str(tmp_path),
        "NOETL_AUTH_PG_AUTH": fresh_postgres.dsn,
        "NOETL_AUTH_NATS_CREDENTIAL": json.dumps({"url": NATS_URL, "token": nats_token}),
    }
    code, status = run_playbook(
        f"sqlite:///{tmp_path / 'noetl.sqlite'}",
        CORPUS_FILE,
        {"auth0_token": token, "session_bucket": bucket, "client_ip": "10.0.0.1"},
        env,
    )
    assert code == 0, status
    assert nats_token not in json.dumps(status)

    with psycopg2.connect(fresh_postgres.dsn) as conn, conn.cursor() as cur:
        cur.execute("SELECT session_token FROM auth.sessions")
        (session_token,) = cur.fetchone()
    conn.close()
    got = nats(operation="kv_get", bucket=bucket, key=session_token)
    assert got.data["status"] == "success", got.data
    assert got.data["value"]["email"] == "ada@example.com" and got.data["value"]["roles"] == []


@pytest.fixture
def token_server(tmp_path: Path) -> Iterator[str]:
    """A nats-server of this test's own on a free loopback port, requiring a token (no JetStream)."""
    import shutil
    import subprocess
    import time

    binary = shutil.which("nats-server")
    if binary is None:
        svc.unavailable("nats-server is not installed")
    port = svc.free_port()
    proc = subprocess.Popen(
        [str(binary), "-a", "127.0.0.1", "-p", str(port), "--auth", "s3cret-nats-token"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 10
        while not _reachable(f"nats://127.0.0.1:{port}"):
            assert proc.poll() is None and time.monotonic() < deadline, "nats-server did not start"
            time.sleep(0.05)
        yield f"nats://127.0.0.1:{port}"
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def test_a_refused_token_and_a_server_without_jetstream_are_named(token_server: str) -> None:
    wrong = nats(credential={"url": token_server, "token": "wrong-token-123"}, operation="kv_get", bucket="b", key="k")
    assert wrong.error is not None
    assert wrong.error["kind"] == "authorization" and not wrong.error["retryable"]
    assert wrong.error["message"] == f"nats: the server at {token_server} refused the credential"
    right = nats(
        credential={"url": token_server, "token": "s3cret-nats-token"}, operation="kv_get", bucket="b", key="k"
    )
    assert right.error is not None and right.error["kind"] == "nats_error", right.error
    assert "JetStream is not enabled" in right.error["message"]
    in_url = token_server.replace("nats://", "nats://s3cret-nats-token@")
    out = nats(credential=in_url, operation="kv_keys", bucket="b")
    assert out.error is not None and "s3cret" not in out.error["message"]
