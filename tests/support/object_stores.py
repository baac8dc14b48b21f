"""Real emulated object stores for tests: moto's S3 server and gcp-storage-emulator.

Each runs as a subprocess on a free loopback port, is waited for until it answers HTTP, and is
stopped when the context ends. `s3_server()` yields an S3Endpoint (the endpoint URL and a test
access key pair moto accepts); `gcs_server()` yields the emulator's endpoint URL. The tests'
credentials are mappings in the shape the tools read (see noetl_celery/tools/object_store.py).
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import requests

from tests.support.services import free_port, stop_process, unavailable

START_TIMEOUT = 60.0  # seconds an emulator may take to answer


@dataclass(frozen=True)
class S3Endpoint:
    url: str
    access_key: str = "AKIATESTOBJSTOREKEY1"
    secret_key: str = "objstore-secret-key-0123456789abcdef"  # a test value, masked like a real one

    def credential(self) -> dict[str, Any]:
        return {
            "aws_access_key_id": self.access_key,
            "aws_secret_access_key": self.secret_key,
            "endpoint_url": self.url,
            "region": "us-east-1",
        }

    def client(self) -> Any:
        import boto3

        return boto3.client(
            "s3",
            endpoint_url=self.url,
            region_name="us-east-1",
            aws_access_key_id=self.access_key,
            aws_secret_access_key=self.secret_key,
        )


def _wait_http(url: str, proc: subprocess.Popen, log: Path) -> None:
    deadline = time.monotonic() + START_TIMEOUT
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{proc.args[0]} exited ({proc.returncode}): {log.read_text(errors='replace')[-2000:]}")
        try:
            requests.get(url, timeout=1)
            return
        except requests.RequestException:
            time.sleep(0.2)
    stop_process(proc)
    raise RuntimeError(f"{proc.args[0]} did not answer at {url} within {START_TIMEOUT:g} s")


@contextmanager
def _serve(argv: list[str], url: str, name: str) -> Iterator[None]:
    with tempfile.TemporaryDirectory(prefix=f"{name}-") as folder:
        log = Path(folder) / "log"
        with open(log, "wb") as out:
            proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, cwd=folder)
        try:
            _wait_http(url, proc, log)
            yield
        finally:
            stop_process(proc)


def _program(name: str) -> str:
    found = shutil.which(name) or str(Path(sys.executable).with_name(name))
    if not Path(found).exists():
        unavailable(f"{name} is not installed (pip install -e '.[test]')")
    return found


@contextmanager
def s3_server() -> Iterator[S3Endpoint]:
    """moto in server mode on 127.0.0.1:<free port>."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    with _serve([_program("moto_server"), "-H", "127.0.0.1", "-p", str(port)], url, "moto"):
        yield S3Endpoint(url)


@contextmanager
def gcs_server() -> Iterator[str]:
    """gcp-storage-emulator on 127.0.0.1:<free port>, its data in memory."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    argv = [_program("gcp-storage-emulator"), "start", "--host", "127.0.0.1", "--port", str(port), "--in-memory"]
    with _serve(argv, url, "gcs"):
        yield url


def gcs_credential(url: str, project: str = "test-project") -> dict[str, Any]:
    return {"endpoint_url": url, "project": project}


def gcs_client(url: str) -> Any:
    from google.api_core.client_options import ClientOptions
    from google.auth.credentials import AnonymousCredentials
    from google.cloud import storage

    return storage.Client(
        project="test-project", credentials=AnonymousCredentials(), client_options=ClientOptions(api_endpoint=url)
    )
