"""One streaming API over S3 (`s3://`), Google Cloud Storage (`gs://`) and local paths.

Decides how an object location is named, how a credential (the resolved `auth:` of a task) and a
custom endpoint reach the client, how objects are read and written as binary streams with
bounded memory, and which error kind each failure of a store becomes. The tools `s3`, `gcs` and
`artifact`, the `script:` sources `s3`/`gcs`, and any format layer over binary streams use it.

Locations (`parse`):
    s3://bucket/key            Amazon S3 or any S3-compatible endpoint (boto3, extra `s3`)
    gs://bucket/name           Google Cloud Storage (google-cloud-storage, extra `gcs`; gcs:// too)
    file:///abs/path, /abs/path, rel/path
                               the worker's file system (a relative path is relative to `base`)

API (every function takes `uri`, an optional `credential` and keyword options; see `Options`):
    open_read(uri, credential=None, **options) -> BinaryIO
        A readable binary stream (a context manager); S3 and GCS are read in chunks as the
        caller reads, never whole.
    open_write(uri, credential=None, content_type=None, metadata=None, **options) -> context manager -> BinaryIO
        A writable binary stream. What is written is spooled (in memory up to SPOOL_BYTES, then
        a temporary file) and the object is created when the `with` block ends without an
        exception: a reader never sees a half-written object, a failed or killed write leaves
        the previous object (or none). Local files are written to a temporary file in the same
        folder and renamed into place.
    get_bytes(uri, credential=None, max_bytes=None, **options) -> bytes
        The whole body; more than `max_bytes` raises ObjectTooLarge (nothing is cut).
    put_bytes(uri, data, credential=None, content_type=None, metadata=None, **options) -> ObjectInfo
    upload_file(path, uri, credential=None, content_type=None, metadata=None, **options) -> ObjectInfo
    download_file(uri, path, credential=None, **options) -> int   (bytes; the file appears whole)
    stat(uri, credential=None, **options) -> ObjectInfo        (ObjectNotFound when missing)
    list_objects(uri, credential=None, limit=1000, **options) -> (list[ObjectInfo], truncated)
        `uri` is a prefix: s3://bucket/prefix, gs://bucket/prefix, a folder (its files, recursively).
    delete(uri, credential=None, **options) -> bool            (False when nothing was there)

Options (keyword arguments, each also read from the credential mapping when not given):
    endpoint_url  S3: a custom endpoint (MinIO, moto; also `endpoint`, `s3_endpoint`, or the
                  env var AWS_ENDPOINT_URL that boto3 reads). GCS: the API endpoint of an
                  emulator (also `api_endpoint`, `emulator_host`, or STORAGE_EMULATOR_HOST).
    region        S3 region (`region`/`region_name`; default us-east-1).
    project       GCS project (`project`/`project_id`; default from the service account, else "noetl").
    base          the folder a relative local path is resolved against (default: the current one).
    timeout       seconds for connecting and for each read (default CLIENT_TIMEOUT).

Credentials (a mapping; never logged, never in an error message):
    S3   aws_access_key_id | access_key_id | key_id, aws_secret_access_key | secret_access_key |
         secret_key | secret, aws_session_token | session_token; none: boto3's own chain.
    GCS  service_account_json (JSON text or mapping), or the service-account mapping itself
         (`type: service_account`); with an emulator endpoint and no service account the
         client is anonymous; none: Application Default Credentials.

Errors: ObjectStoreError with `kind` (a ToolErrorKind: not_found, authorization, credential,
connection and timeout (retryable), invalid_args, too_large, object_store) and `retryable`; its
message names the location, never a secret.
"""

from __future__ import annotations

import contextlib
import io
import os
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from noetl_celery.core.vocabulary import ToolErrorKind
from noetl_celery.tools.settings import ToolSettings

SPOOL_BYTES = 8 * 1024 * 1024  # a write is kept in memory up to this size, then in a temporary file
READ_CHUNK_BYTES = 1024 * 1024  # bytes asked of S3/GCS per read of a stream
CLIENT_TIMEOUT = 60.0  # seconds to connect and per read, unless options say otherwise
DEFAULT_REGION = "us-east-1"
DEFAULT_GCS_PROJECT = "noetl"
SCHEMES = {"s3": "s3", "gs": "gs", "gcs": "gs", "file": "file"}
EXTRAS = {"s3": ("s3", ("boto3",)), "gs": ("gcs", ("google.cloud.storage",))}

_S3_KEY_ID = ("aws_access_key_id", "access_key_id", "key_id")
_S3_SECRET = ("aws_secret_access_key", "secret_access_key", "secret_key", "secret")
_S3_SESSION = ("aws_session_token", "session_token")
_S3_ENDPOINT = ("endpoint_url", "endpoint", "s3_endpoint")
_GCS_ENDPOINT = ("endpoint_url", "api_endpoint", "endpoint", "emulator_host")
_REGION = ("region", "region_name")
Meta = dict[str, Any] | None  # user metadata of an object (S3 x-amz-meta-*, GCS metadata)
_PROJECT = ("project", "project_id")


class CallRefused(Exception):
    """A call of an object-store tool (gcs, s3, artifact) that cannot be made as configured; `kind`
    is the attempt's error kind (invalid_args unless said)."""

    def __init__(self, message: str, kind: str = ToolErrorKind.INVALID_ARGS) -> None:
        super().__init__(message)
        self.kind = kind


class ObjectStoreSettings(ToolSettings):
    """The settings every object-store tool takes: its client's endpoint, region and project,
    and the bound on what a read may bring back."""

    content_type: str | None = None
    max_bytes: int | None = None
    endpoint_url: str | None = None
    region: str | None = None
    project: str | None = None


class ObjectStoreError(Exception):
    """A store refused or failed an operation; `kind` is the attempt's error kind."""

    def __init__(self, message: str, kind: str = "object_store", retryable: bool = False) -> None:
        super().__init__(message)
        self.kind = kind
        self.retryable = retryable


class ObjectNotFound(ObjectStoreError):
    def __init__(self, message: str) -> None:
        super().__init__(message, ToolErrorKind.NOT_FOUND)


class ObjectTooLarge(ObjectStoreError):
    def __init__(self, message: str) -> None:
        super().__init__(message, ToolErrorKind.TOO_LARGE)


@dataclass(frozen=True)
class Location:
    """A parsed object location: scheme "s3", "gs" or "file"; bucket None for "file"."""

    scheme: str
    bucket: str | None
    key: str  # the object key / blob name; for "file" the path

    @property
    def uri(self) -> str:
        if self.scheme == "file":
            return self.key
        return f"{self.scheme}://{self.bucket}/{self.key}"


@dataclass(frozen=True)
class ObjectInfo:
    uri: str
    key: str
    size: int | None
    content_type: str | None = None
    etag: str | None = None
    updated: str | None = None  # ISO 8601

    def to_dict(self) -> dict[str, Any]:
        return {
            "uri": self.uri,
            "key": self.key,
            "size": self.size,
            "content_type": self.content_type,
            "etag": self.etag,
            "updated": self.updated,
        }


def parse(uri: str, base: str | None = None) -> Location:
    """The location `uri` names (ObjectStoreError kind invalid_args when it names none)."""
    if not isinstance(uri, str) or not uri.strip():
        raise ObjectStoreError("an object location must be a non-empty string", ToolErrorKind.INVALID_ARGS)
    text = uri.strip()
    scheme, sep, rest = text.partition("://")
    if not sep:
        return Location("file", None, _local_path(text, base))
    normal = SCHEMES.get(scheme.lower())
    if normal is None:
        known = ", ".join(f"{s}://" for s in SCHEMES)
        raise ObjectStoreError(f"{text}: unknown scheme '{scheme}://'; use one of {known}", ToolErrorKind.INVALID_ARGS)
    if normal == "file":
        return Location("file", None, _local_path(rest, base))
    bucket, _, key = rest.partition("/")
    if not bucket:
        raise ObjectStoreError(f"{text}: names no bucket", ToolErrorKind.INVALID_ARGS)
    return Location(normal, bucket, key)


def _local_path(path: str, base: str | None) -> str:
    target = Path(path).expanduser()
    if not target.is_absolute():
        target = Path(base or os.getcwd()) / target
    return str(target)


def missing_extra(uri_or_scheme: str) -> str | None:
    """The pip line to install when the client library of this location's store is missing."""
    from noetl_celery.tools.base import missing_extra as missing

    scheme = SCHEMES.get(uri_or_scheme.partition("://")[0].lower(), uri_or_scheme)
    if scheme not in EXTRAS:
        return None
    extra, modules = EXTRAS[scheme]
    return missing(f"{scheme}:// objects", extra, modules)


def _pick(options: dict[str, Any], credential: Any, keys: tuple[str, ...]) -> Any:
    for source in (options, credential if isinstance(credential, dict) else {}):
        for key in keys:
            value = source.get(key)
            if value not in (None, ""):
                return value
    return None


# --- the stores -------------------------------------------------------------------------------


class _Store:
    """One backend; `loc` is always of this store's scheme."""

    def open_read(self, loc: Location) -> IO[bytes]:
        raise NotImplementedError

    def upload(self, loc: Location, stream: IO[bytes], content_type: str | None, metadata: Meta = None) -> None:
        raise NotImplementedError

    def stat(self, loc: Location) -> ObjectInfo:
        raise NotImplementedError

    def list(self, loc: Location, limit: int) -> tuple[list[ObjectInfo], bool]:
        raise NotImplementedError

    def delete(self, loc: Location) -> bool:
        raise NotImplementedError


class _ChunkReader(io.RawIOBase):
    """A raw binary stream over `read(n)` of a client's body; `close` closes the body."""

    def __init__(self, read: Callable[[int], bytes], close: Callable[[], None], name: str) -> None:
        self._read = read
        self._close = close
        self.name = name

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        data = self._read(len(buffer))
        buffer[: len(data)] = data
        return len(data)

    def close(self) -> None:
        if not self.closed:
            with contextlib.suppress(Exception):
                self._close()
        super().close()


class _LocalStore(_Store):
    def open_read(self, loc: Location) -> IO[bytes]:
        try:
            return open(loc.key, "rb")
        except FileNotFoundError:
            raise ObjectNotFound(f"{loc.key}: no such file") from None
        except OSError as exc:
            raise ObjectStoreError(f"{loc.key}: cannot be read: {exc.strerror or exc}") from None

    def upload(self, loc: Location, stream: IO[bytes], content_type: str | None, metadata: Meta = None) -> None:
        folder = os.path.dirname(loc.key) or "."
        try:
            os.makedirs(folder, exist_ok=True)
            fd, temporary = tempfile.mkstemp(dir=folder, prefix=".partial-")
        except OSError as exc:
            raise ObjectStoreError(f"{loc.key}: cannot be written: {exc.strerror or exc}") from None
        try:
            with os.fdopen(fd, "wb") as out:
                while chunk := stream.read(READ_CHUNK_BYTES):
                    out.write(chunk)
            os.replace(temporary, loc.key)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(temporary)
            raise

    def stat(self, loc: Location) -> ObjectInfo:
        try:
            st = os.stat(loc.key)
        except FileNotFoundError:
            raise ObjectNotFound(f"{loc.key}: no such file") from None
        return ObjectInfo(loc.key, loc.key, st.st_size, updated=_iso(st.st_mtime))

    def list(self, loc: Location, limit: int) -> tuple[list[ObjectInfo], bool]:
        root = Path(loc.key)
        if not root.exists():
            return [], False
        paths = [root] if root.is_file() else (p for p in sorted(root.rglob("*")) if p.is_file())
        found: list[ObjectInfo] = []
        for path in paths:
            if len(found) == limit:
                return found, True
            found.append(self.stat(Location("file", None, str(path))))
        return found, False

    def delete(self, loc: Location) -> bool:
        try:
            os.unlink(loc.key)
            return True
        except FileNotFoundError:
            return False


def _iso(epoch: float) -> str:
    from datetime import UTC, datetime

    return datetime.fromtimestamp(epoch, UTC).isoformat()


class _S3Store(_Store):
    def __init__(self, credential: Any, options: dict[str, Any]) -> None:
        import boto3
        from botocore.config import Config

        endpoint = _pick(options, credential, _S3_ENDPOINT)
        timeout = float(options.get("timeout") or CLIENT_TIMEOUT)
        config = Config(
            connect_timeout=timeout,
            read_timeout=timeout,
            retries={"max_attempts": 2, "mode": "standard"},
            s3={"addressing_style": "path"} if endpoint else None,
        )
        self.client = boto3.session.Session().client(
            "s3",
            region_name=str(_pick(options, credential, _REGION) or DEFAULT_REGION),
            endpoint_url=str(endpoint) if endpoint else None,
            aws_access_key_id=_pick({}, credential, _S3_KEY_ID),
            aws_secret_access_key=_pick({}, credential, _S3_SECRET),
            aws_session_token=_pick({}, credential, _S3_SESSION),
            config=config,
        )

    def open_read(self, loc: Location) -> IO[bytes]:
        with _s3_errors(loc):
            body = self.client.get_object(Bucket=loc.bucket, Key=loc.key)["Body"]
        return io.BufferedReader(_ChunkReader(body.read, body.close, loc.uri), READ_CHUNK_BYTES)

    def upload(self, loc: Location, stream: IO[bytes], content_type: str | None, metadata: Meta = None) -> None:
        extra: dict[str, Any] = {"ContentType": content_type} if content_type else {}
        if metadata:
            extra["Metadata"] = {str(k): str(v) for k, v in metadata.items()}
        with _s3_errors(loc):
            self.client.upload_fileobj(stream, loc.bucket, loc.key, ExtraArgs=extra or None)

    def stat(self, loc: Location) -> ObjectInfo:
        with _s3_errors(loc):
            head = self.client.head_object(Bucket=loc.bucket, Key=loc.key)
        modified = head.get("LastModified")
        return ObjectInfo(
            loc.uri,
            loc.key,
            head.get("ContentLength"),
            head.get("ContentType"),
            str(head.get("ETag", "")).strip('"') or None,
            modified.isoformat() if modified else None,
        )

    def list(self, loc: Location, limit: int) -> tuple[list[ObjectInfo], bool]:
        found: list[ObjectInfo] = []
        paginator = self.client.get_paginator("list_objects_v2")
        with _s3_errors(loc):
            for page in paginator.paginate(Bucket=loc.bucket, Prefix=loc.key):
                for item in page.get("Contents", []):
                    if len(found) == limit:
                        return found, True
                    modified = item.get("LastModified")
                    found.append(
                        ObjectInfo(
                            f"s3://{loc.bucket}/{item['Key']}",
                            item["Key"],
                            item.get("Size"),
                            etag=str(item.get("ETag", "")).strip('"') or None,
                            updated=modified.isoformat() if modified else None,
                        )
                    )
        return found, False

    def delete(self, loc: Location) -> bool:
        try:
            self.stat(loc)
        except ObjectNotFound:
            return False
        with _s3_errors(loc):
            self.client.delete_object(Bucket=loc.bucket, Key=loc.key)
        return True


@contextlib.contextmanager
def _s3_errors(loc: Location) -> Iterator[None]:
    from botocore.exceptions import BotoCoreError, ClientError, ConnectionError, NoCredentialsError, ReadTimeoutError

    try:
        yield
    except ClientError as exc:
        error = exc.response.get("Error", {})
        code = str(error.get("Code", ""))
        status = exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
        text = f"{loc.uri}: {code or status}: {error.get('Message') or 'refused'}"
        if code in ("NoSuchKey", "NoSuchBucket", "404", "NotFound") or status == 404:
            raise ObjectNotFound(f"{loc.uri}: not found ({code or status})") from None
        if code in ("AccessDenied", "InvalidAccessKeyId", "SignatureDoesNotMatch", "403") or status in (401, 403):
            raise ObjectStoreError(text, ToolErrorKind.AUTHORIZATION) from None
        raise ObjectStoreError(text, retryable=bool(status and status >= 500)) from None
    except NoCredentialsError:
        raise ObjectStoreError(f"{loc.uri}: no S3 credentials (give `auth:`)", ToolErrorKind.CREDENTIAL) from None
    except ConnectionError as exc:
        raise ObjectStoreError(f"{loc.uri}: {type(exc).__name__}: {exc}", ToolErrorKind.CONNECTION, True) from None
    except ReadTimeoutError as exc:
        raise ObjectStoreError(f"{loc.uri}: no answer in time: {exc}", ToolErrorKind.TIMEOUT, True) from None
    except BotoCoreError as exc:
        raise ObjectStoreError(f"{loc.uri}: {type(exc).__name__}: {exc}") from None


class _GcsStore(_Store):
    def __init__(self, credential: Any, options: dict[str, Any]) -> None:
        from google.api_core.client_options import ClientOptions
        from google.auth.credentials import AnonymousCredentials
        from google.cloud import storage

        endpoint = _pick(options, credential, _GCS_ENDPOINT) or os.environ.get("STORAGE_EMULATOR_HOST")
        account = _service_account(credential)
        project = _pick(options, credential, _PROJECT) or (account or {}).get("project_id") or DEFAULT_GCS_PROJECT
        client_options = ClientOptions(api_endpoint=_with_scheme(str(endpoint))) if endpoint else None
        creds: Any = None
        if account is not None:
            from google.oauth2 import service_account

            creds = service_account.Credentials.from_service_account_info(account)
        elif endpoint:
            creds = AnonymousCredentials()
        self.timeout = float(options.get("timeout") or CLIENT_TIMEOUT)
        # the client's retries stop after two timeouts' worth of time, not its default two minutes
        self.retry = storage.retry.DEFAULT_RETRY.with_timeout(2 * self.timeout)
        with _gcs_errors(Location("gs", "-", "")):
            self.client = storage.Client(project=str(project), credentials=creds, client_options=client_options)

    def _blob(self, loc: Location) -> Any:
        return self.client.bucket(loc.bucket).blob(loc.key)

    def open_read(self, loc: Location) -> IO[bytes]:
        blob = self._blob(loc)
        with _gcs_errors(loc):
            blob.reload(timeout=self.timeout, retry=self.retry)  # not found is raised here, not at the first read
            stream = blob.open("rb", chunk_size=READ_CHUNK_BYTES, timeout=self.timeout, retry=self.retry)
        return io.BufferedReader(_ChunkReader(_guarded(stream.read, loc), stream.close, loc.uri), READ_CHUNK_BYTES)

    def upload(self, loc: Location, stream: IO[bytes], content_type: str | None, metadata: Meta = None) -> None:
        blob = self._blob(loc)
        if metadata:
            blob.metadata = {str(k): str(v) for k, v in metadata.items()}
        with _gcs_errors(loc):
            blob.upload_from_file(stream, content_type=content_type, timeout=self.timeout, retry=self.retry)

    def stat(self, loc: Location) -> ObjectInfo:
        blob = self._blob(loc)
        with _gcs_errors(loc):
            blob.reload(timeout=self.timeout, retry=self.retry)
        return _blob_info(loc.bucket or "", blob)

    def list(self, loc: Location, limit: int) -> tuple[list[ObjectInfo], bool]:
        found: list[ObjectInfo] = []
        with _gcs_errors(loc):
            for blob in self.client.list_blobs(
                loc.bucket, prefix=loc.key or None, timeout=self.timeout, retry=self.retry
            ):
                if len(found) == limit:
                    return found, True
                found.append(_blob_info(loc.bucket or "", blob))
        return found, False

    def delete(self, loc: Location) -> bool:
        try:
            with _gcs_errors(loc):
                self._blob(loc).delete(timeout=self.timeout, retry=self.retry)
        except ObjectNotFound:
            return False
        return True


def _with_scheme(endpoint: str) -> str:
    return endpoint if "://" in endpoint else f"http://{endpoint}"


def _service_account(credential: Any) -> dict[str, Any] | None:
    if not isinstance(credential, dict):
        return None
    account = credential.get("service_account_json") or credential.get("service_account")
    if isinstance(account, str):
        import json

        try:
            account = json.loads(account)
        except ValueError:
            raise ObjectStoreError(
                "the GCS credential's service_account_json is not valid JSON", ToolErrorKind.CREDENTIAL
            ) from None
    if isinstance(account, dict):
        return account
    return dict(credential) if credential.get("type") == "service_account" else None


def _blob_info(bucket: str, blob: Any) -> ObjectInfo:
    return ObjectInfo(
        f"gs://{bucket}/{blob.name}",
        blob.name,
        blob.size,
        blob.content_type,
        blob.etag,
        blob.updated.isoformat() if blob.updated else None,
    )


def _guarded(read: Callable[[int], bytes], loc: Location) -> Callable[[int], bytes]:
    def guarded(size: int) -> bytes:
        with _gcs_errors(loc):
            return bytes(read(size))

    return guarded


@contextlib.contextmanager
def _gcs_errors(loc: Location) -> Iterator[None]:
    from google.api_core import exceptions as gexc
    from google.auth import exceptions as auth_exc
    from requests import exceptions as rexc

    try:
        yield
    except gexc.RetryError as exc:
        raise ObjectStoreError(
            f"{loc.uri}: no answer in time: {exc.cause or exc}", ToolErrorKind.TIMEOUT, True
        ) from None
    except gexc.NotFound as exc:
        raise ObjectNotFound(f"{loc.uri}: not found ({exc.code})") from None
    except (gexc.Forbidden, gexc.Unauthorized) as exc:
        raise ObjectStoreError(f"{loc.uri}: {exc.code}: {exc.message}", ToolErrorKind.AUTHORIZATION) from None
    except auth_exc.DefaultCredentialsError:
        raise ObjectStoreError(
            f"{loc.uri}: no GCS credentials (give `auth:` with service_account_json, or an emulator endpoint)",
            ToolErrorKind.CREDENTIAL,
        ) from None
    except (gexc.ServerError, gexc.TooManyRequests) as exc:
        raise ObjectStoreError(f"{loc.uri}: {exc.code}: {exc.message}", retryable=True) from None
    except gexc.GoogleAPICallError as exc:
        raise ObjectStoreError(f"{loc.uri}: {exc.code}: {exc.message}") from None
    except rexc.Timeout as exc:
        raise ObjectStoreError(f"{loc.uri}: no answer in time: {exc}", ToolErrorKind.TIMEOUT, True) from None
    except rexc.ConnectionError as exc:
        raise ObjectStoreError(f"{loc.uri}: {type(exc).__name__}: {exc}", ToolErrorKind.CONNECTION, True) from None


def _store(loc: Location, credential: Any, options: dict[str, Any]) -> _Store:
    if loc.scheme == "file":
        return _LocalStore()
    missing = missing_extra(loc.scheme)
    if missing is not None:
        raise ObjectStoreError(missing, ToolErrorKind.UNKNOWN_TOOL)
    return _S3Store(credential, options) if loc.scheme == "s3" else _GcsStore(credential, options)


def _object_location(uri: str, options: dict[str, Any]) -> Location:
    loc = parse(uri, options.get("base"))
    if loc.scheme != "file" and not loc.key:
        raise ObjectStoreError(f"{uri}: names a bucket but no object", ToolErrorKind.INVALID_ARGS)
    return loc


# --- the API ----------------------------------------------------------------------------------


def open_read(uri: str, credential: Any = None, **options: Any) -> IO[bytes]:
    loc = _object_location(uri, options)
    return _store(loc, credential, options).open_read(loc)


@contextlib.contextmanager
def open_write(
    uri: str, credential: Any = None, content_type: str | None = None, metadata: Meta = None, **options: Any
) -> Iterator[IO[bytes]]:
    loc = _object_location(uri, options)
    store = _store(loc, credential, options)
    with tempfile.SpooledTemporaryFile(max_size=SPOOL_BYTES) as spool:
        yield spool  # type: ignore[misc]
        spool.seek(0)
        store.upload(loc, spool, content_type, metadata)  # type: ignore[arg-type]


def upload_file(
    path: str, uri: str, credential: Any = None, content_type: str | None = None, metadata: Meta = None, **options: Any
) -> ObjectInfo:
    """Copy the local file `path` to the object `uri` (streamed; the object appears whole or not at all)."""
    loc = _object_location(uri, options)
    store = _store(loc, credential, options)
    with _local_file(path) as stream:
        size = os.fstat(stream.fileno()).st_size
        store.upload(loc, stream, content_type, metadata)
    return ObjectInfo(loc.uri, loc.key, size, content_type)


@contextlib.contextmanager
def _local_file(path: str) -> Iterator[IO[bytes]]:
    """`path` open for reading; a file that cannot be opened is an ObjectStoreError naming it."""
    try:
        stream = open(path, "rb")  # noqa: SIM115 -- closed by the with below, after the error mapping
    except OSError as exc:
        kind = ToolErrorKind.NOT_FOUND if isinstance(exc, FileNotFoundError) else "object_store"
        raise ObjectStoreError(f"{path}: cannot be read: {exc.strerror or exc}", kind) from None
    with stream:
        yield stream


def download_file(uri: str, path: str, credential: Any = None, **options: Any) -> int:
    """Copy the object `uri` to the local file `path` (streamed; the file appears whole or not at
    all: written to a temporary file beside it and renamed). Returns the bytes written."""
    written = 0
    with open_read(uri, credential, **options) as stream:
        counted = _Counting(stream)
        _LocalStore().upload(Location("file", None, path), counted, None)  # type: ignore[arg-type]
        written = counted.count
    return written


class _Counting:
    def __init__(self, stream: IO[bytes]) -> None:
        self.stream = stream
        self.count = 0

    def read(self, size: int = -1) -> bytes:
        data = self.stream.read(size)
        self.count += len(data)
        return data


def get_bytes(uri: str, credential: Any = None, max_bytes: int | None = None, **options: Any) -> bytes:
    with open_read(uri, credential, **options) as stream:
        data = stream.read(-1 if max_bytes is None else max_bytes + 1)
    if max_bytes is not None and len(data) > max_bytes:
        raise ObjectTooLarge(f"{uri} holds more than {max_bytes} bytes")
    return data


def put_bytes(
    uri: str,
    data: bytes,
    credential: Any = None,
    content_type: str | None = None,
    metadata: Meta = None,
    **options: Any,
) -> ObjectInfo:
    loc = _object_location(uri, options)
    _store(loc, credential, options).upload(loc, io.BytesIO(data), content_type, metadata)
    return ObjectInfo(loc.uri, loc.key, len(data), content_type)


def stat(uri: str, credential: Any = None, **options: Any) -> ObjectInfo:
    loc = _object_location(uri, options)
    return _store(loc, credential, options).stat(loc)


def list_objects(uri: str, credential: Any = None, limit: int = 1000, **options: Any) -> tuple[list[ObjectInfo], bool]:
    loc = parse(uri, options.get("base"))
    return _store(loc, credential, options).list(loc, limit)


def delete(uri: str, credential: Any = None, **options: Any) -> bool:
    loc = _object_location(uri, options)
    return _store(loc, credential, options).delete(loc)
