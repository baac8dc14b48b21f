"""The transfer tool with an object-storage side: s3:// CSV, JSONL and Parquet objects copied
into the machine's PostgreSQL and back, against moto in server mode on a loopback port (the
same object-store module the s3/gcs tools use), and a missing object failing as `not_found`."""

from __future__ import annotations

import csv
import io
from collections.abc import Iterator
from typing import Any

import psycopg2
import pytest

from noetl_celery.tools.base import ToolCall, run_tool
from tests.support.object_stores import S3Endpoint, s3_server

BUCKET = "transfer-objects"
ROWS = 1500


@pytest.fixture(scope="module")
def s3() -> Iterator[S3Endpoint]:
    with s3_server() as endpoint:
        endpoint.client().create_bucket(Bucket=BUCKET)
        yield endpoint


@pytest.fixture
def pg(fresh_postgres) -> Iterator[str]:
    with psycopg2.connect(fresh_postgres.dsn) as conn, conn.cursor() as cur:
        cur.execute("CREATE TABLE dst (id int PRIMARY KEY, city text, amount numeric(10,2))")
    yield fresh_postgres.dsn


def transfer(config: dict[str, Any]) -> Any:
    return run_tool(ToolCall(kind="transfer", config=config, timeout=60))


def pg_rows(dsn: str, sql: str) -> list[tuple]:
    with psycopg2.connect(dsn) as conn, conn.cursor() as cur:
        cur.execute(sql)
        return cur.fetchall()


def a_csv() -> bytes:
    out = io.StringIO()
    writer = csv.writer(out)
    writer.writerow(["id", "city", "amount"])
    writer.writerows((i, f"city-{i}", f"{i * 1.25:.2f}") for i in range(1, ROWS + 1))
    return out.getvalue().encode()


def test_a_csv_object_goes_into_postgres_and_back_out_in_each_format(s3: S3Endpoint, pg: str) -> None:
    s3.client().put_object(Bucket=BUCKET, Key="in/cities.csv", Body=a_csv())
    into = transfer(
        {
            "source": {"type": "s3", "path": f"s3://{BUCKET}/in/cities.csv", "auth": s3.credential()},
            "target": {"type": "postgres", "auth": {"dsn": pg}, "table": "dst"},
            "chunk_size": 500,
        }
    )
    assert into.status == "ok", into.error
    assert (into.data["rows_transferred"], into.data["chunks_processed"]) == (ROWS, 3)
    expected = pg_rows(pg, "SELECT count(*), sum(amount), max(city) FROM dst")
    assert expected[0][0] == ROWS

    for fmt in ("csv", "jsonl", "parquet"):
        key = f"out/cities.{fmt}"
        out = transfer(
            {
                "source": {"type": "postgres", "auth": {"dsn": pg}, "query": "SELECT * FROM dst ORDER BY id"},
                "target": {"type": "s3", "path": f"s3://{BUCKET}/{key}", "auth": s3.credential()},
                "chunk_size": 400,
            }
        )
        assert out.status == "ok", (fmt, out.error)
        assert out.data["rows_transferred"] == ROWS
        assert s3.client().head_object(Bucket=BUCKET, Key=key)["ContentLength"] > 0
        back = transfer(
            {
                "source": {"type": fmt, "path": f"s3://{BUCKET}/{key}", "auth": s3.credential()},
                "target": {"type": "postgres", "auth": {"dsn": pg}, "table": "dst"},
                "mode": "replace",
            }
        )
        assert back.status == "ok", (fmt, back.error)
        assert back.data["rows_transferred"] == ROWS
        assert pg_rows(pg, "SELECT count(*), sum(amount), max(city) FROM dst") == expected, fmt


def test_the_round_trip_csv_is_the_rows_written(s3: S3Endpoint, pg: str) -> None:
    with psycopg2.connect(pg) as conn, conn.cursor() as cur:
        cur.execute("INSERT INTO dst VALUES (1, 'Paris', 1.50), (2, 'Lima', 2.25)")
    out = transfer(
        {
            "source": {"type": "postgres", "auth": {"dsn": pg}, "query": "SELECT id, city FROM dst ORDER BY id"},
            "target": {"type": "csv", "path": f"s3://{BUCKET}/exact.csv", "auth": s3.credential()},
        }
    )
    assert out.status == "ok", out.error
    body = s3.client().get_object(Bucket=BUCKET, Key="exact.csv")["Body"].read().decode()
    assert list(csv.reader(io.StringIO(body))) == [["id", "city"], ["1", "Paris"], ["2", "Lima"]]


def test_a_missing_object_fails_not_found_and_a_bucket_alone_is_refused(s3: S3Endpoint, pg: str) -> None:
    missing = transfer(
        {
            "source": {"type": "csv", "path": f"s3://{BUCKET}/nothing-here.csv", "auth": s3.credential()},
            "target": {"type": "postgres", "auth": {"dsn": pg}, "table": "dst"},
        }
    )
    assert missing.status == "error" and missing.error["kind"] == "not_found", missing.error
    assert "nothing-here.csv" in missing.error["message"]
    assert s3.secret_key not in str(missing.error)
    bucket_only = transfer(
        {
            "source": {"type": "postgres", "auth": {"dsn": pg}, "query": "SELECT 1 AS x"},
            "target": {"type": "csv", "path": f"s3://{BUCKET}", "auth": s3.credential()},
        }
    )
    assert bucket_only.status == "error" and bucket_only.error["kind"] == "invalid_args", bucket_only.error
    assert "names a bucket but no object" in bucket_only.error["message"]
