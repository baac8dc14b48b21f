"""The s3, gcs and artifact tools and the gcs/s3 script sources through real worker processes on
Redis + PostgreSQL, against moto's S3 server and gcp-storage-emulator started by the test.

Proves: tests/playbooks/object_stores.yaml completes on workers; an object body above the result
cap reaches the next step whole (stored once by reference, not cut), one above the call's
max_bytes fails the run with kind too_large; the S3 access key (id and secret) appears in no event
row, no worker log and no command output.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from noetl_celery.store.db import migrate
from noetl_celery.tools import object_store
from tests.support.engines import cli
from tests.support.object_stores import gcs_client, gcs_credential, gcs_server, s3_server

PLAYBOOK = Path(__file__).resolve().parents[1] / "playbooks" / "object_stores.yaml"
GREET = "def main(name):\n    return {'greeting': 'hello ' + name}\n"
CSV = "id,city\n1,Paris\n2,Lima\n"
BIG_BYTES = 1_500_000  # above the default 1 MB result cap
BIG = """apiVersion: noetl.io/v2
kind: Playbook
metadata: {name: big_object}
workflow:
  - step: start
    tool: {kind: s3, auth: s3_test, action: get, uri: "s3://noetl-s3/big/body.txt"}
    next: [{step: measure}]
  - step: measure
    tool:
      kind: python
      args: {body: "{{ start.content }}"}
      code: |
        def main(body):
            return {"length": len(body), "distinct": sorted(set(body))}
"""
REFUSED = """apiVersion: noetl.io/v2
kind: Playbook
metadata: {name: refused_object}
workflow:
  - step: start
    tool: {kind: s3, auth: s3_test, action: get, uri: "s3://noetl-s3/big/body.txt", max_bytes: 1000}
"""


def submit(playbook: Path, env: dict[str, str], *sets: str) -> dict:
    args = ["submit", "--wait", "--json", "--timeout", "180", str(playbook)]
    for item in sets:
        args += ["--set", item]
    proc = cli(args, env)
    assert proc.stdout.strip(), proc.stderr
    status = json.loads(proc.stdout)
    status["_output"] = proc.stdout + proc.stderr
    return status


@pytest.mark.timeout(600)
def test_object_store_tools_on_real_workers(tmp_path: Path, fresh_postgres, redis_url, worker_factory) -> None:
    migrate(fresh_postgres.url)
    store_env = {"NOETL_BROKER_URL": redis_url, "NOETL_DATABASE_URL": fresh_postgres.url}
    with s3_server() as s3, gcs_server() as gcs:
        s3.client().create_bucket(Bucket="noetl-s3")
        gcs_client(gcs).create_bucket("noetl-gcs")
        object_store.put_bytes("s3://noetl-s3/scripts/greet.py", GREET.encode(), s3.credential())
        object_store.put_bytes("gs://noetl-gcs/scripts/greet.py", GREET.encode(), gcs_credential(gcs))
        object_store.put_bytes("s3://noetl-s3/big/body.txt", b"z" * BIG_BYTES, s3.credential())
        credentials = {
            "NOETL_AUTH_S3_TEST": json.dumps(s3.credential()),
            "NOETL_AUTH_GCS_TEST": json.dumps(gcs_credential(gcs)),
        }
        worker = worker_factory(env={**store_env, **credentials}, concurrency=2)
        local = tmp_path / "cities.csv"
        local.write_text(CSV)
        artifacts = tmp_path / "artifacts"
        status = submit(PLAYBOOK, store_env, f"local_file={local}", f"artifact_dir={artifacts}")
        (tmp_path / "big.yaml").write_text(BIG)
        big = submit(tmp_path / "big.yaml", store_env)
        (tmp_path / "refused.yaml").write_text(REFUSED)
        refused = submit(tmp_path / "refused.yaml", store_env)
        listed = object_store.list_objects("s3://noetl-s3/artifacts/", s3.credential())[0]

    assert status["status"] == "completed", status
    results = status["results"]
    assert results["end"] == {
        "local": {"s3_bytes": len(CSV), "gcs_keys": ["uploads/cities.csv"]},
        "greetings": ["hello s3", "hello gcs"],
    }
    assert results["start"]["uri"] == "s3://noetl-s3/incoming/cities.csv"
    assert [o.key for o in listed] == ["artifacts/listing.json.gz"]
    assert json.loads((artifacts / "summary.json").read_text())["gcs_keys"] == ["uploads/cities.csv"]

    assert big["status"] == "completed", big
    assert big["results"]["measure"] == {"length": BIG_BYTES, "distinct": ["z"]}  # whole, never cut
    assert refused["status"] == "failed" and refused["error"]["kind"] == "too_large", refused
    assert "holds 1500000 bytes" in refused["error"]["message"]

    dump = subprocess.run(
        ["pg_dump", "--data-only", fresh_postgres.dsn], capture_output=True, text=True, timeout=120, check=True
    ).stdout
    assert "__stored__" in dump  # the big body went by reference
    for where, text in (
        ("store", dump),
        ("worker log", worker.log_text()),
        ("output", status["_output"] + big["_output"] + refused["_output"]),
    ):
        assert s3.secret_key not in text, f"the S3 secret key is in the {where}"
        assert s3.access_key not in text, f"the S3 access key id is in the {where}"
