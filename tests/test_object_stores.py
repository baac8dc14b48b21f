"""The s3, gcs and artifact tools and the gcs/s3 script sources, against real emulated endpoints
started here: moto's S3 server and gcp-storage-emulator, each on a free loopback port."""

from __future__ import annotations

import gzip
import hashlib
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from noetl_celery.tools import object_store
from noetl_celery.tools import script as scripts
from noetl_celery.tools.base import Outcome, ToolCall, run_tool
from tests.support.harness import run_playbook
from tests.support.object_stores import S3Endpoint, gcs_client, gcs_credential, gcs_server, s3_server

PLAYBOOK = Path(__file__).parent / "playbooks" / "object_stores.yaml"
S3_BUCKET = "noetl-s3"
GCS_BUCKET = "noetl-gcs"
GREET = "def main(name):\n    return {'greeting': 'hello ' + name}\n"
CSV = "id,city\n1,Paris\n2,Lima\n"


@pytest.fixture(scope="module")
def s3() -> Iterator[S3Endpoint]:
    with s3_server() as endpoint:
        endpoint.client().create_bucket(Bucket=S3_BUCKET)
        yield endpoint


@pytest.fixture(scope="module")
def gcs() -> Iterator[str]:
    with gcs_server() as url:
        gcs_client(url).create_bucket(GCS_BUCKET)
        yield url


def tool(kind: str, credential: Any = None, **config: Any) -> Outcome:
    return run_tool(ToolCall(kind=kind, config=config, credential=credential, timeout=30))


@pytest.mark.parametrize("scheme", ["s3", "gs"])
def test_each_action_round_trips(scheme: str, s3: S3Endpoint, gcs: str, tmp_path: Path) -> None:
    kind, bucket, cred = (
        ("s3", S3_BUCKET, s3.credential()) if scheme == "s3" else ("gcs", GCS_BUCKET, gcs_credential(gcs))
    )
    name_key = "key" if scheme == "s3" else "blob"
    local = tmp_path / "cities.csv"
    local.write_text(CSV)

    up = tool(kind, cred, source=str(local), destination=f"{scheme}://{bucket}/round/")
    assert up.status == "ok", up.error
    assert up.data == {
        "status": "success",
        "uri": f"{scheme}://{bucket}/round/cities.csv",
        "bucket": bucket,
        name_key: "round/cities.csv",
        "size": len(CSV),
        "content_type": "text/csv",
        "message": f"Uploaded {len(CSV)} bytes to {scheme}://{bucket}/round/cities.csv",
    }
    got = tool(kind, cred, action="get", uri=up.data["uri"])
    assert got.status == "ok", got.error
    assert got.data["content"] == CSV and got.data["encoding"] == "utf-8" and got.data["size"] == len(CSV)

    put = tool(kind, cred, action="put", bucket=bucket, key="round/doc.json", data={"a": [1, 2]})
    assert put.status == "ok" and put.data["content_type"] == "application/json", put.error
    parsed = tool(kind, cred, action="get", uri=f"{scheme}://{bucket}/round/doc.json", decode="json")
    assert parsed.data["data"] == {"a": [1, 2]}
    binary = tool(kind, cred, action="put", uri=f"{scheme}://{bucket}/round/bin", content="x")
    assert binary.status == "ok"
    object_store.put_bytes(f"{scheme}://{bucket}/round/bin", b"\xff\x00\xfe", cred)
    raw = tool(kind, cred, action="get", uri=f"{scheme}://{bucket}/round/bin")
    assert raw.data["encoding"] == "base64" and raw.data["content"] == "/wD+"

    listed = tool(kind, cred, action="list", uri=f"{scheme}://{bucket}/round/")
    assert listed.status == "ok", listed.error
    assert [o["key"] for o in listed.data["objects"]] == ["round/bin", "round/cities.csv", "round/doc.json"]
    assert listed.data["count"] == 3 and listed.data["truncated"] is False
    first = tool(kind, cred, action="list", bucket=bucket, prefix="round/", max_keys=2)
    assert first.data["count"] == 2 and first.data["truncated"] is True

    target = tmp_path / "out" / "copy.csv"
    down = tool(kind, cred, action="download", source=up.data["uri"], destination=str(target))
    assert down.status == "ok", down.error
    assert target.read_text() == CSV and down.data["size"] == len(CSV) and down.data["path"] == str(target)

    gone = tool(kind, cred, action="delete", uri=up.data["uri"])
    again = tool(kind, cred, action="delete", uri=up.data["uri"])  # a retried delete succeeds
    assert (gone.data["deleted"], again.data["deleted"]) == (True, False)
    missing = tool(kind, cred, action="get", uri=up.data["uri"])
    assert missing.status == "error" and missing.error["kind"] == "not_found", missing.error
    assert up.data["uri"] in missing.error["message"]


@pytest.mark.parametrize("scheme", ["s3", "gs"])
def test_a_body_above_the_limit_is_refused_never_cut(scheme: str, s3: S3Endpoint, gcs: str) -> None:
    kind, bucket, cred = (
        ("s3", S3_BUCKET, s3.credential()) if scheme == "s3" else ("gcs", GCS_BUCKET, gcs_credential(gcs))
    )
    uri = f"{scheme}://{bucket}/big/blob.txt"
    with object_store.open_write(uri, cred) as out:
        for _ in range(64):
            out.write(b"y" * 16384)  # 1 MiB, streamed
    refused = tool(kind, cred, action="get", uri=uri, max_bytes=100_000)
    assert refused.status == "error" and refused.error["kind"] == "too_large", refused.error
    assert f"{uri} holds 1048576 bytes" in refused.error["message"] and "action: download" in refused.error["message"]
    whole = tool(kind, cred, action="get", uri=uri)  # under NOETL_MAX_STORED_BYTES: whole, by reference
    assert whole.status == "ok" and len(whole.data["content"]) == 1048576


def test_the_stream_api_reads_in_chunks_and_a_failed_write_leaves_no_object(s3: S3Endpoint, gcs: str) -> None:
    for uri, cred in (
        (f"s3://{S3_BUCKET}/stream/x", s3.credential()),
        (f"gs://{GCS_BUCKET}/stream/x", gcs_credential(gcs)),
    ):
        with pytest.raises(RuntimeError), object_store.open_write(uri, cred) as out:
            out.write(b"half")
            raise RuntimeError("the writer dies")
        with pytest.raises(object_store.ObjectNotFound):
            object_store.stat(uri, cred)
        with object_store.open_write(uri, cred, content_type="text/plain") as out:
            out.write(b"0123456789" * 300_000)
        with object_store.open_read(uri, cred) as stream:
            first = stream.read(10)
            rest = b"".join(iter(lambda: stream.read(65536), b""))
        assert first == b"0123456789" and len(rest) == 2_999_990
        assert object_store.stat(uri, cred).size == 3_000_000


def test_a_closed_endpoint_is_a_retryable_connection_error(s3: S3Endpoint) -> None:
    from tests.support.services import free_port

    cred = {**s3.credential(), "endpoint_url": f"http://127.0.0.1:{free_port()}"}
    failed = tool("s3", cred, action="get", uri=f"s3://{S3_BUCKET}/x", timeout=3)
    assert failed.status == "error" and failed.error["kind"] == "connection" and failed.error["retryable"], failed.error
    assert s3.secret_key not in json.dumps(failed.to_dict())


def test_wrong_scheme_and_missing_fields_are_named() -> None:
    wrong = tool("s3", None, action="get", uri="gs://b/k")
    assert wrong.error["kind"] == "invalid_args" and "is not a s3:// location" in wrong.error["message"]
    none = tool("gcs", None, action="get")
    assert none.error["kind"] == "invalid_args" and "`uri` or `source`" in none.error["message"]
    bad = tool("gcs", None, action="rename", uri="gs://b/k")
    assert "action 'rename' is unknown" in bad.error["message"]


def test_artifacts_on_a_local_folder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("NOETL_ARTIFACT_DIR", str(tmp_path))
    data = {"rows": [{"id": 1}, {"id": 2}]}
    put = tool("artifact", action="put", uri="artifact://results/run1.json", data=data)
    assert put.status == "ok", put.error
    text = json.dumps(data).encode()
    stored = tmp_path / "results" / "run1.json.gz"
    assert put.data == {
        "status": "success",
        "uri": "artifact://results/run1.json.gz",  # as NoETL: an artifact:// location is given back as it was
        "size_bytes": stored.stat().st_size,
        "sha256": hashlib.sha256(text).hexdigest(),
        "compressed": True,
    }
    assert gzip.decompress(stored.read_bytes()) == text
    before = stored.read_bytes()
    assert tool("artifact", action="put", uri="artifact://results/run1.json", data=data).status == "ok"
    assert stored.read_bytes() == before  # a retried put writes the same bytes

    got = tool("artifact", action="get", input={"result_ref": {"kind": "result_ref", "ref": put.data["uri"]}})
    assert got.status == "ok", got.error
    assert got.data == {
        "status": "success",
        "data": data,
        "uri": put.data["uri"],
        "size_bytes": len(before),
        "compressed": True,
    }
    plain = tool("artifact", action="put", uri=str(tmp_path / "note.txt"), data="just text", compress=False)
    assert tool("artifact", uri=plain.data["uri"]).data["data"] == "just text"
    missing = tool("artifact", uri="artifact://nope.json")
    assert missing.error["kind"] == "not_found"
    empty = tool("artifact", action="get", input={"result_ref": ""})  # NoETL's {{ start._ref }}, rendered
    assert empty.error["kind"] == "invalid_args" and "read a step's result as {{ step_name }}" in empty.error["message"]
    refused = tool("artifact", input={"result_ref": "noetl://execution/1/result/start/1"})
    assert refused.error["kind"] == "invalid_args" and "NoETL's own result store" in refused.error["message"]


def test_artifacts_on_s3_and_gcs(s3: S3Endpoint, gcs: str) -> None:
    for uri, cred in (
        (f"s3://{S3_BUCKET}/art/a.json", s3.credential()),
        (f"gs://{GCS_BUCKET}/art/a.json", gcs_credential(gcs)),
    ):
        put = tool("artifact", cred, action="put", uri=uri, data=[1, "two", {"three": 3}])
        assert put.status == "ok" and put.data["uri"] == uri + ".gz", put.error
        got = tool("artifact", cred, action="get", uri=put.data["uri"])
        assert got.status == "ok" and got.data["data"] == [1, "two", {"three": 3}], got.error
        small = tool("artifact", cred, action="get", uri=put.data["uri"], max_bytes=5)
        assert small.error["kind"] == "too_large", small.error


def test_script_sources_read_objects(s3: S3Endpoint, gcs: str, monkeypatch: pytest.MonkeyPatch) -> None:
    object_store.put_bytes(f"s3://{S3_BUCKET}/scripts/greet.py", GREET.encode(), s3.credential())
    object_store.put_bytes(f"gs://{GCS_BUCKET}/scripts/greet.py", GREET.encode(), gcs_credential(gcs))
    monkeypatch.setenv("NOETL_AUTH_S3_TEST", json.dumps(s3.credential()))
    monkeypatch.setenv("NOETL_AUTH_GCS_TEST", json.dumps(gcs_credential(gcs)))
    by_bucket = {"path": "scripts/greet.py", "source": {"type": "s3", "bucket": S3_BUCKET, "auth": "s3_test"}}
    assert scripts.load(by_bucket, None) == GREET
    by_uri = {
        "uri": f"gs://{GCS_BUCKET}/scripts/greet.py",
        "source": {"type": "gcs", "auth": {"credential": "gcs_test"}},
    }
    assert scripts.load(by_uri, None) == GREET
    with pytest.raises(scripts.ScriptError, match="not found"):
        scripts.load({**by_bucket, "path": "scripts/none.py"}, None)
    with pytest.raises(ValueError, match=r"needs uri \(gs://bucket/key\), or source.bucket and path"):
        scripts.Script.model_validate({"path": "x.py", "source": {"type": "gcs"}})


def test_the_playbook_runs_every_tool_and_no_secret_is_shown(s3: S3Endpoint, gcs: str, tmp_path: Path) -> None:
    object_store.put_bytes(f"s3://{S3_BUCKET}/scripts/greet.py", GREET.encode(), s3.credential())
    object_store.put_bytes(f"gs://{GCS_BUCKET}/scripts/greet.py", GREET.encode(), gcs_credential(gcs))
    local = tmp_path / "cities.csv"
    local.write_text(CSV)
    env = {
        "NOETL_HOME": str(tmp_path / "home"),
        "NOETL_AUTH_S3_TEST": json.dumps(s3.credential()),
        "NOETL_AUTH_GCS_TEST": json.dumps(gcs_credential(gcs)),
    }
    sets = {"local_file": str(local), "artifact_dir": str(tmp_path / "artifacts")}
    code, status = run_playbook(f"sqlite:///{tmp_path / 'noetl.sqlite'}", PLAYBOOK, sets, env)
    assert code == 0, status
    results = status["results"]
    assert results["read_s3"]["content"] == CSV
    assert results["gcs_list"]["objects"][0]["key"] == "uploads/cities.csv"
    assert results["load_listing"]["data"]["keys"] == ["uploads/cities.csv"]
    assert results["end"] == {
        "local": {"s3_bytes": len(CSV), "gcs_keys": ["uploads/cities.csv"]},
        "greetings": ["hello s3", "hello gcs"],
    }
    assert json.loads((tmp_path / "artifacts" / "summary.json").read_text())["s3_bytes"] == len(CSV)
    blob = gcs_client(gcs).bucket(GCS_BUCKET).get_blob("uploads/cities.csv")
    assert blob.metadata == {"origin": "object_stores"} and blob.content_type == "text/csv"
    assert s3.secret_key not in json.dumps(status)


NOETL_FORMS = """\
apiVersion: noetl.io/v10
kind: Playbook
metadata: {name: forms, path: tests/forms}
workflow:
  - step: start
    tool:
      - upload:
          kind: gcs
          source: /tmp/output.csv
          destination: gs://my-bucket/data/output.csv
          credential: gcp_service_account
      - copy: {kind: s3, action: put, uri: "s3://b/k.json", data: {a: 1}, auth: aws}
      - load_artifact:
          kind: artifact
          action: get
          input:
            result_ref: "{{ start._ref }}"
"""


def test_noetl_forms_validate_and_a_missing_client_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    from noetl_celery.core.errors import PlaybookError
    from noetl_celery.dsl import load_plan
    from noetl_celery.tools import base

    tasks = load_plan("forms.yaml", text=NOETL_FORMS).steps["start"].tasks
    assert [t.kind for t in tasks] == ["gcs", "s3", "artifact"]
    monkeypatch.setattr(base, "module_installed", lambda name: name != "google.cloud.storage")
    with pytest.raises(PlaybookError) as raised:
        load_plan("forms.yaml", text=NOETL_FORMS)
    assert "tool kind 'gcs' needs google.cloud.storage" in str(raised.value)
    assert "pip install 'noetl_celery[gcs]'" in str(raised.value)


SQL_FROM_S3 = """\
apiVersion: noetl.io/v2
kind: Playbook
metadata: {name: sql_from_s3, path: tests/sql_from_s3}
workload:
  sql_uri: s3://noetl-s3/sql/make_table.sql
  aws: aws_credentials
workflow:
  - step: start
    tool:
      kind: postgres
      auth: pg_local
      script:
        uri: "{{ workload.sql_uri }}"
        source: {type: s3, region: us-east-1, auth: "{{ workload.aws }}"}
    next: [{step: count}]
  - step: count
    tool: {kind: postgres, auth: pg_local, command: "SELECT count(*) AS n FROM object_store_probe"}
"""


def test_a_postgres_script_read_from_s3_by_a_templated_uri(s3: S3Endpoint, fresh_postgres: Any, tmp_path: Path) -> None:
    sql = "CREATE TABLE object_store_probe (id int);\nINSERT INTO object_store_probe VALUES (1), (2), (3);\n"
    object_store.put_bytes(f"s3://{S3_BUCKET}/sql/make_table.sql", sql.encode(), s3.credential())
    playbook = tmp_path / "sql_from_s3.yaml"
    playbook.write_text(SQL_FROM_S3)
    env = {
        "NOETL_HOME": str(tmp_path / "home"),
        "NOETL_AUTH_PG_LOCAL": fresh_postgres.dsn,
        "NOETL_AUTH_AWS_CREDENTIALS": json.dumps(s3.credential()),
    }
    code, status = run_playbook(f"sqlite:///{tmp_path / 'noetl.sqlite'}", playbook, {}, env)
    assert code == 0, status
    assert status["results"]["count"]["rows"] == [{"n": 3}]
    failed = run_playbook(
        f"sqlite:///{tmp_path / 'noetl2.sqlite'}", playbook, {"sql_uri": "s3://noetl-s3/sql/none.sql"}, env
    )[1]
    assert failed["status"] == "failed" and failed["error"]["kind"] == "script", failed
    assert "s3://noetl-s3/sql/none.sql: not found" in failed["error"]["message"]
    assert s3.secret_key not in json.dumps([status, failed])


def test_an_endpoint_that_never_answers_is_a_retryable_timeout() -> None:
    import threading
    import time
    from http.server import BaseHTTPRequestHandler

    from tests.support.loopback import serve

    release = threading.Event()

    class Silent(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 -- the handler's protocol name
            release.wait(30)

        do_HEAD = do_GET

        def log_message(self, *args: Any) -> None:
            pass

    with serve(Silent) as url:
        try:
            for kind, uri, cred in (
                (
                    "s3",
                    "s3://bucket-x/k",
                    {"endpoint_url": url, "aws_access_key_id": "a", "aws_secret_access_key": "b"},
                ),
                ("gcs", "gs://bucket-x/k", {"endpoint_url": url}),
            ):
                started = time.monotonic()
                outcome = run_tool(
                    ToolCall(kind=kind, config={"action": "get", "uri": uri}, credential=cred, timeout=1)
                )
                assert outcome.status == "error" and outcome.error["kind"] == "timeout", (kind, outcome.error)
                assert outcome.error["retryable"] is True
                assert time.monotonic() - started < 20, kind
        finally:
            release.set()
