"""Object storage on the S3 API (``boto3``), shared by the kernel cache and the weight service.

A location is written ``s3://BUCKET[/PREFIX]`` (:func:`parse_s3_url`). Endpoint, region and
credentials come from boto3's default chain, never from warmserve: ``AWS_ACCESS_KEY_ID`` /
``AWS_SECRET_ACCESS_KEY`` / ``AWS_SESSION_TOKEN``, ``AWS_PROFILE``, ``~/.aws/config`` and
``~/.aws/credentials``, an instance role; ``AWS_ENDPOINT_URL_S3`` or ``AWS_ENDPOINT_URL`` (or
``endpoint_url`` in the profile) for a non-AWS endpoint such as MinIO or ``moto_server``.

:class:`ObjectStore` is one location (bucket + key prefix) with the few operations both services
build on, every one of them streaming (an object is never held in memory whole):

- :meth:`ObjectStore.put_file` / :meth:`ObjectStore.put_bytes`: an upload that is visible whole
  or not at all, by default *conditional* (``If-None-Match: *``): exactly one of N racing writers
  of a key wins, the others get ``False``. The object carries its ``size-bytes`` and ``sha256``
  as user metadata (the sha256 is also sent as ``ChecksumSHA256``, which S3 checks on arrival).
  Files above ``multipart_bytes`` go up in parts, made visible by one conditional
  ``CompleteMultipartUpload``.
- :meth:`ObjectStore.download`: one GET streamed into a writer while it is counted and hashed;
  bytes whose size or sha256 differ from the object's metadata (or metadata that is missing or
  garbled) raise :class:`CorruptObject`, so a caller never keeps them as good.
- :meth:`ObjectStore.delete` (conditional on the ETag when given, so removing a corrupt object
  never removes a fresh one published meanwhile), :meth:`ObjectStore.head`,
  :meth:`ObjectStore.list`.
- :meth:`ObjectStore.check`: at a daemon's start, the bucket must exist and be readable, and the
  endpoint must honour conditional writes (a probe object is written twice, the second write
  must be refused, then removed); anything else is ``InvalidArgument`` (CLI exit 2) with one
  sentence naming the endpoint, the bucket and the cause.

Errors at run time: an unreachable endpoint, a timeout, throttling or a 5xx is
:class:`~services.errors.Unavailable`; a missing bucket, denied access or missing credentials is
:class:`~services.errors.FailedPrecondition`; both name the operation and say nothing was stored
when a write failed.
"""

from __future__ import annotations

import base64
import hashlib
import logging
import math
import re
import time
import urllib.parse
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

from services.errors import FailedPrecondition, InvalidArgument, Unavailable, WarmserveError

log = logging.getLogger(__name__)

SCHEME = "s3://"
#: Chunk size of downloads and of the hashing of uploads, in bytes.
CHUNK_BYTES = 1 << 20
#: Files larger than this (bytes) are uploaded in parts (a single PUT takes at most 5 GiB).
MULTIPART_BYTES = 256 << 20
#: Part size of a multipart upload in bytes (S3 wants >= 5 MiB for all but the last part).
PART_BYTES = 64 << 20
_MAX_PARTS = 10_000
#: User-metadata keys every object written here carries (S3 lower-cases them).
META_SIZE, META_SHA256 = "size-bytes", "sha256"
#: S3 allows 2 KiB of user metadata; a free-text value is cut to this many characters.
MAX_META_CHARS = 256

_BUCKET = re.compile(r"[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]")
_SEGMENT = re.compile(r"[A-Za-z0-9._=+-]+")
_HEX64 = re.compile(r"[0-9a-f]{64}")


class CorruptObject(WarmserveError):
    """An object's bytes do not match its recorded size or sha256, or its metadata is missing or
    garbled. ``key`` is the object's key (relative to the store), ``etag`` the version read."""

    def __init__(self, message: str, key: str = "", etag: str = "") -> None:
        super().__init__(message)
        self.key, self.etag = key, etag


@dataclass(frozen=True)
class S3Location:
    """A bucket and a key prefix (``""`` or ``"a/b"``: no leading, trailing or doubled ``/``)."""

    bucket: str
    prefix: str = ""

    def key(self, *parts: str) -> str:
        """The full object key of ``parts`` under the prefix, joined with ``/``."""
        return "/".join(p for p in (self.prefix, *parts) if p)

    def child(self, *parts: str) -> S3Location:
        """The location ``parts`` below this one (same bucket)."""
        return S3Location(self.bucket, self.key(*parts))

    def __str__(self) -> str:
        return f"{SCHEME}{self.bucket}/{self.prefix}" if self.prefix else f"{SCHEME}{self.bucket}"


def is_s3_url(text: object) -> bool:
    """Whether ``text`` is meant as an ``s3://`` URL (it may still be malformed)."""
    return isinstance(text, str) and text.strip().lower().startswith(SCHEME)


def parse_s3_url(url: object) -> S3Location:
    """``s3://BUCKET[/PREFIX]`` as an :class:`S3Location`.

    The bucket follows S3's naming rules (3..63 characters: lower-case letters, digits, ``.``
    and ``-``, starting and ending with a letter or digit); each prefix segment uses
    ``[A-Za-z0-9._=+-]`` and is neither ``.`` nor ``..``; a trailing ``/`` is dropped. Raises
    ``InvalidArgument`` naming what is wrong (no ``s3://``, no bucket, a bad bucket name, an empty
    or bad segment, a query or fragment).
    """
    if not isinstance(url, str) or not url.strip():
        raise InvalidArgument("the object store URL is empty; write it as s3://BUCKET/PREFIX")
    text = url.strip()
    if not text.lower().startswith(SCHEME):
        raise InvalidArgument(f"object store URL {text[:80]!r} must start with s3:// (s3://BUCKET/PREFIX)")
    rest = text[len(SCHEME):]
    if "?" in rest or "#" in rest:
        raise InvalidArgument(f"object store URL {text[:80]!r} must not have a query or fragment")
    bucket, _, prefix = rest.partition("/")
    if not bucket:
        raise InvalidArgument(f"object store URL {text[:80]!r} names no bucket (s3://BUCKET/PREFIX)")
    if not _BUCKET.fullmatch(bucket) or ".." in bucket:
        raise InvalidArgument(f"{bucket[:80]!r} is not a valid S3 bucket name (3-63 characters: lower-case "
                              "letters, digits, '.' and '-', starting and ending with a letter or digit)")
    prefix = prefix.rstrip("/")
    if prefix:
        for segment in prefix.split("/"):
            if not segment:
                raise InvalidArgument(f"object store URL {text[:80]!r} has an empty path segment ('//')")
            if not _SEGMENT.fullmatch(segment) or segment in (".", ".."):
                raise InvalidArgument(f"prefix segment {segment[:40]!r} of {text[:80]!r} may only use letters, "
                                      "digits, '.', '_', '=', '+' and '-', and must not be '.' or '..'")
    return S3Location(bucket, prefix)


def make_client():
    """A boto3 S3 client from the default chain (environment, config files, instance role);
    the endpoint comes from ``AWS_ENDPOINT_URL_S3`` / ``AWS_ENDPOINT_URL`` when set. Connect
    timeout 5 s, read timeout 60 s; retries as the chain says (``AWS_MAX_ATTEMPTS``, ...)."""
    import boto3
    from botocore.config import Config

    session = boto3.session.Session()
    return session.client("s3", config=Config(connect_timeout=5, read_timeout=60))


def encode_meta(text: str) -> str:
    """Free text as an S3 metadata value: ASCII (percent-encoded), at most :data:`MAX_META_CHARS`."""
    return urllib.parse.quote(str(text)[:MAX_META_CHARS], safe=" :/@._-+=,")


def decode_meta(value: str) -> str:
    """The inverse of :func:`encode_meta`."""
    return urllib.parse.unquote(value)


@dataclass(frozen=True)
class ObjectHead:
    """What S3 says about one object: ``key`` (relative to the store), ``size`` in bytes, ``etag``
    (quoted, as S3 sends it), user ``metadata`` (lower-case keys), ``last_modified`` (unix s)."""

    key: str
    size: int
    etag: str
    metadata: dict[str, str]
    last_modified: float


def _sha256_b64(hex_digest: str) -> str:
    return base64.b64encode(bytes.fromhex(hex_digest)).decode()


def hash_stream(f: BinaryIO) -> tuple[int, str]:
    """``(size in bytes, sha256 hex)`` of what is left in ``f``, read in chunks."""
    sha, size = hashlib.sha256(), 0
    while block := f.read(CHUNK_BYTES):
        sha.update(block)
        size += len(block)
    return size, sha.hexdigest()


class ObjectStore:
    """Objects under ``location`` (keys given to the methods are relative to its prefix).

    ``client``: a boto3 S3 client (default :func:`make_client`). ``multipart_bytes`` /
    ``part_bytes``: above which size a file is uploaded in parts, and the part size (bytes).
    Thread-safe (boto3 clients are). Methods raise ``Unavailable`` / ``FailedPrecondition`` as the
    module docstring says.
    """

    def __init__(self, location: S3Location, client=None, *, multipart_bytes: int = MULTIPART_BYTES,
                 part_bytes: int = PART_BYTES) -> None:
        self.location = location
        self.client = client if client is not None else make_client()
        self.multipart_bytes, self.part_bytes = multipart_bytes, part_bytes

    @classmethod
    def from_url(cls, url: str, **kwargs) -> ObjectStore:
        """The store at ``s3://BUCKET/PREFIX`` (``InvalidArgument`` for a malformed URL)."""
        return cls(parse_s3_url(url), **kwargs)

    def child(self, *parts: str) -> ObjectStore:
        """The store ``parts`` below this one, sharing its client."""
        return ObjectStore(self.location.child(*parts), self.client, multipart_bytes=self.multipart_bytes,
                           part_bytes=self.part_bytes)

    @property
    def endpoint(self) -> str:
        """The endpoint URL the client talks to."""
        return str(getattr(self.client.meta, "endpoint_url", "") or "the default AWS endpoint")

    def url(self, key: str = "") -> str:
        """``s3://BUCKET/PREFIX/key``."""
        return str(self.location.child(key)) if key else str(self.location)

    def _key(self, key: str) -> str:
        return self.location.key(key)

    # ------------------------------------------------------------------ errors

    def _error(self, e: Exception, what: str) -> WarmserveError:
        """The :class:`WarmserveError` for a boto3/botocore exception during ``what``."""
        from botocore import exceptions as bx

        where = f"{self.url()} at {self.endpoint}"
        if isinstance(e, bx.NoCredentialsError | bx.PartialCredentialsError):
            return FailedPrecondition(f"{what}: no AWS credentials for {where} (set AWS_ACCESS_KEY_ID and "
                                      "AWS_SECRET_ACCESS_KEY, AWS_PROFILE, or ~/.aws/credentials)")
        if isinstance(e, bx.ParamValidationError):
            return InvalidArgument(f"{what}: {e}")
        if isinstance(e, bx.EndpointConnectionError | bx.ConnectTimeoutError | bx.ReadTimeoutError
                      | bx.ConnectionClosedError | bx.IncompleteReadError | bx.ResponseStreamingError
                      | bx.HTTPClientError):
            return Unavailable(f"{what}: cannot reach the object store {where}: {e}")
        if isinstance(e, bx.ClientError):
            code = str(e.response.get("Error", {}).get("Code", ""))
            status = int(e.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0) or 0)
            message = e.response.get("Error", {}).get("Message", "") or code
            if code == "NoSuchBucket":
                return FailedPrecondition(f"{what}: bucket {self.location.bucket!r} does not exist at {self.endpoint}")
            if status == 403 or code in ("AccessDenied", "InvalidAccessKeyId", "SignatureDoesNotMatch"):
                return FailedPrecondition(f"{what}: access to {where} denied ({code}: {message})")
            if status >= 500 or code in ("SlowDown", "RequestTimeout", "ServiceUnavailable", "InternalError"):
                return Unavailable(f"{what}: the object store {where} is unavailable ({code}: {message})")
            return FailedPrecondition(f"{what}: the object store {where} refused ({code or status}: {message})")
        if isinstance(e, bx.BotoCoreError):
            return Unavailable(f"{what}: object store {where}: {e}")
        return WarmserveError(f"{what}: {e}")

    @staticmethod
    def _code(e: Exception) -> str:
        from botocore.exceptions import ClientError

        if isinstance(e, ClientError):
            return str(e.response.get("Error", {}).get("Code", "")) or str(
                e.response.get("ResponseMetadata", {}).get("HTTPStatusCode", ""))
        return ""

    def _call(self, what: str, method: str, **kwargs):
        """``client.<method>(**kwargs)``, errors translated (:meth:`_error`)."""
        from botocore.exceptions import BotoCoreError, ClientError

        try:
            return getattr(self.client, method)(**kwargs)
        except (BotoCoreError, ClientError) as e:
            raise self._error(e, what) from e

    # ------------------------------------------------------------------ start-up check

    def check(self, *, conditional_writes: bool = True) -> None:
        """Fail fast on a store that cannot work: the bucket must exist and answer, and (with
        ``conditional_writes``) the endpoint must refuse a second ``If-None-Match: *`` write of a
        key (the probe object, ``.warmserve-probe-<uuid>`` under the prefix, is removed). Raises
        ``InvalidArgument`` with one sentence for an unreachable endpoint, a missing bucket,
        denied access, missing credentials, or an endpoint that ignores conditional writes."""
        from botocore.exceptions import BotoCoreError, ClientError

        try:
            self.client.head_bucket(Bucket=self.location.bucket)
        except (BotoCoreError, ClientError) as e:
            if self._code(e) in ("404", "NoSuchBucket", "NotFound"):
                raise InvalidArgument(f"cannot use the object store {self.url()}: bucket {self.location.bucket!r} "
                                      f"does not exist at {self.endpoint}; create it first") from e
            raise InvalidArgument(f"cannot use the object store {self.url()}: "
                                  f"{self._error(e, 'opening the bucket')}") from e
        if not conditional_writes:
            return
        probe = f".warmserve-probe-{uuid.uuid4().hex}"
        try:
            first = self.put_bytes(probe, b"probe", what="probing conditional writes")
            second = self.put_bytes(probe, b"probe again", what="probing conditional writes")
            self.delete(probe)
        except WarmserveError as e:
            raise InvalidArgument(f"cannot use the object store {self.url()}: {e}") from e
        if not first or second:
            raise InvalidArgument(f"the object store at {self.endpoint} ignores conditional writes "
                                  "(If-None-Match), so racing publishers could overwrite each other; use an "
                                  "endpoint that supports them (AWS S3, MinIO, ...)")

    # ------------------------------------------------------------------ reads

    def head(self, key: str) -> ObjectHead | None:
        """The object's :class:`ObjectHead`, ``None`` when it does not exist."""
        from botocore.exceptions import BotoCoreError, ClientError

        try:
            r = self.client.head_object(Bucket=self.location.bucket, Key=self._key(key))
        except ClientError as e:
            if self._code(e) in ("404", "NoSuchKey", "NotFound"):
                return None
            raise self._error(e, f"looking up {self.url(key)}") from e
        except BotoCoreError as e:
            raise self._error(e, f"looking up {self.url(key)}") from e
        return self._head(key, r)

    @staticmethod
    def _head(key: str, r: dict) -> ObjectHead:
        modified = r.get("LastModified")
        return ObjectHead(key, int(r.get("ContentLength", 0)), str(r.get("ETag", "")),
                          {k.lower(): v for k, v in (r.get("Metadata") or {}).items()},
                          modified.timestamp() if modified is not None else 0.0)

    def download(self, key: str, sink: BinaryIO, *, expect_size: int | None = None,
                 expect_sha256: str | None = None) -> ObjectHead | None:
        """Stream the object into ``sink`` (anything with ``write``) and verify it: its size and
        sha256 must equal its metadata (and ``expect_size`` / ``expect_sha256`` when given).
        Returns its :class:`ObjectHead`, ``None`` when it does not exist (nothing written).
        Raises :class:`CorruptObject` on a mismatch or missing metadata (what was written to
        ``sink`` must then be discarded), ``Unavailable`` when the transfer breaks."""
        from botocore.exceptions import BotoCoreError, ClientError

        what = f"downloading {self.url(key)}"
        try:
            r = self.client.get_object(Bucket=self.location.bucket, Key=self._key(key))
        except ClientError as e:
            if self._code(e) in ("404", "NoSuchKey", "NotFound"):
                return None
            raise self._error(e, what) from e
        except BotoCoreError as e:
            raise self._error(e, what) from e
        head = self._head(key, r)
        sha, size = hashlib.sha256(), 0
        body = r["Body"]
        try:
            for block in body.iter_chunks(CHUNK_BYTES):
                sha.update(block)
                size += len(block)
                sink.write(block)
        except (BotoCoreError, ClientError) as e:
            raise self._error(e, what) from e
        finally:
            body.close()
        problem = self._mismatch(head, size, sha.hexdigest(), expect_size, expect_sha256)
        if problem:
            raise CorruptObject(f"{self.url(key)} is corrupt: {problem}", key, head.etag)
        return head

    @staticmethod
    def _mismatch(head: ObjectHead, size: int, sha: str, expect_size: int | None,
                  expect_sha: str | None) -> str:
        """Why bytes of ``size`` and ``sha`` read from ``head`` are not the object; ``""`` if they are."""
        meta_size, meta_sha = head.metadata.get(META_SIZE, ""), head.metadata.get(META_SHA256, "")
        if not meta_size.isdigit() or not _HEX64.fullmatch(meta_sha):
            return f"its size-bytes/sha256 metadata is missing or garbled ({meta_size[:20]!r}, {meta_sha[:20]!r})"
        if size != int(meta_size) or sha != meta_sha:
            return f"read {size} bytes with sha256 {sha[:16]}..., its metadata says {meta_size} bytes with " \
                   f"{meta_sha[:16]}..."
        if expect_size is not None and size != expect_size:
            return f"read {size} bytes, {expect_size} were expected"
        if expect_sha is not None and sha != expect_sha:
            return f"sha256 {sha[:16]}... differs from the expected {expect_sha[:16]}..."
        return ""

    def get_bytes(self, key: str, *, limit: int = 16 << 20) -> tuple[ObjectHead, bytes] | None:
        """A small object (at most ``limit`` bytes, e.g. a manifest) verified like
        :meth:`download`; ``None`` when absent. ``CorruptObject`` also when it is larger."""
        import io

        head = self.head(key)
        if head is None:
            return None
        if head.size > limit:
            raise CorruptObject(f"{self.url(key)} has {head.size} bytes, more than the {limit} a manifest may have",
                                key, head.etag)
        buf = io.BytesIO()
        got = self.download(key, buf)
        return (got, buf.getvalue()) if got is not None else None

    def list(self, prefix: str = "") -> Iterator[ObjectHead]:
        """Every object whose key (relative to the store) starts with ``prefix``, in key order
        (``metadata`` empty: a listing does not carry it)."""
        from botocore.exceptions import BotoCoreError, ClientError

        paginator = self.client.get_paginator("list_objects_v2")
        base = self._key("")
        base = f"{base}/" if base else ""
        try:
            for page in paginator.paginate(Bucket=self.location.bucket, Prefix=base + prefix):
                for obj in page.get("Contents", []):
                    modified = obj.get("LastModified")
                    yield ObjectHead(obj["Key"][len(base):], int(obj.get("Size", 0)), str(obj.get("ETag", "")), {},
                                     modified.timestamp() if modified is not None else 0.0)
        except (BotoCoreError, ClientError) as e:
            raise self._error(e, f"listing {self.url(prefix)}") from e

    # ------------------------------------------------------------------ writes

    def put_bytes(self, key: str, data: bytes, *, metadata: dict[str, str] | None = None,
                  if_absent: bool = True, what: str = "") -> bool:
        """Store ``data`` at ``key`` (with ``size-bytes``/``sha256`` metadata); with ``if_absent``
        only when no object has that key. ``True`` when stored, ``False`` when the key was taken."""
        import io

        sha = hashlib.sha256(data).hexdigest()
        return self._put(key, io.BytesIO(data), len(data), sha, metadata, if_absent,
                         what or f"uploading {self.url(key)}")

    def put_file(self, key: str, path: str | Path, *, sha256: str | None = None,
                 metadata: dict[str, str] | None = None, if_absent: bool = True, what: str = "") -> bool:
        """Upload the file at ``path`` to ``key`` (streamed; in parts above ``multipart_bytes``)
        with ``size-bytes``/``sha256`` metadata (``sha256`` hashed here when not given). With
        ``if_absent`` (the default) the object appears only if the key is free: ``True`` when
        stored, ``False`` when another writer got there first. Either the whole object becomes
        visible or nothing does; a failure leaves no object (parts of a multipart upload are
        aborted). Raises ``Unavailable`` / ``FailedPrecondition`` naming ``what``; nothing was
        stored then."""
        what = what or f"uploading {self.url(key)}"
        with open(path, "rb") as f:
            if sha256 is None:
                size, sha256 = hash_stream(f)
                f.seek(0)
            else:
                size = Path(path).stat().st_size
            if size > self.multipart_bytes:
                return self._put_multipart(key, f, size, sha256, metadata, if_absent, what)
            return self._put(key, f, size, sha256, metadata, if_absent, what)

    def _meta(self, size: int, sha: str, metadata: dict[str, str] | None) -> dict[str, str]:
        return {**(metadata or {}), META_SIZE: str(size), META_SHA256: sha}

    def _put(self, key: str, body: BinaryIO, size: int, sha: str, metadata, if_absent: bool, what: str) -> bool:
        kwargs = dict(Bucket=self.location.bucket, Key=self._key(key), Body=body, ContentLength=size,
                      Metadata=self._meta(size, sha, metadata), ChecksumSHA256=_sha256_b64(sha))
        if if_absent:
            kwargs["IfNoneMatch"] = "*"
        return self._conditional(what, lambda: (body.seek(0), self.client.put_object(**kwargs)))

    def _conditional(self, what: str, attempt) -> bool:
        """Run ``attempt`` (a conditional write): ``True`` when it stored, ``False`` on 412 (the
        key is taken). A 409 (a concurrent conditional write in flight) is retried."""
        from botocore.exceptions import BotoCoreError, ClientError

        for n in range(6):
            try:
                attempt()
                return True
            except ClientError as e:
                code = self._code(e)
                if code in ("PreconditionFailed", "412"):
                    return False
                if code in ("ConditionalRequestConflict", "409") and n < 5:
                    time.sleep(0.05 * 2 ** n)
                    continue
                raise self._error(e, f"{what}; nothing was stored") from e
            except BotoCoreError as e:
                raise self._error(e, f"{what}; nothing was stored") from e
        return False  # pragma: no cover - the loop always returns or raises

    def _put_multipart(self, key: str, f: BinaryIO, size: int, sha: str, metadata, if_absent: bool,
                       what: str) -> bool:
        from botocore.exceptions import BotoCoreError, ClientError

        part = max(self.part_bytes, math.ceil(size / _MAX_PARTS))
        full_key = self._key(key)
        upload = self._call(what, "create_multipart_upload", Bucket=self.location.bucket, Key=full_key,
                            Metadata=self._meta(size, sha, metadata))
        upload_id = upload["UploadId"]
        done = False
        try:
            parts = []
            for number in range(1, math.ceil(size / part) + 1):
                data = f.read(part)
                r = self._call(f"{what}; nothing was stored", "upload_part", Bucket=self.location.bucket,
                               Key=full_key, UploadId=upload_id, PartNumber=number, Body=data)
                parts.append({"ETag": r["ETag"], "PartNumber": number})
            kwargs = dict(Bucket=self.location.bucket, Key=full_key, UploadId=upload_id,
                          MultipartUpload={"Parts": parts})
            if if_absent:
                kwargs["IfNoneMatch"] = "*"
            stored = self._conditional(what, lambda: self.client.complete_multipart_upload(**kwargs))
            done = stored
            return stored
        finally:
            if not done:
                try:
                    self.client.abort_multipart_upload(Bucket=self.location.bucket, Key=full_key, UploadId=upload_id)
                except (BotoCoreError, ClientError) as e:  # the bucket's lifecycle rule cleans up what is left
                    log.warning("could not abort a multipart upload", extra={"key": full_key, "error": str(e)})

    def delete(self, key: str, *, etag: str | None = None) -> bool:
        """Remove ``key``; with ``etag``, only the version with that ETag (a replaced object is kept:
        ``False``). ``True`` when the delete went through (also when nothing was there). An endpoint
        without conditional deletes (``NotImplemented``) gets a plain delete."""
        from botocore.exceptions import BotoCoreError, ClientError

        kwargs = dict(Bucket=self.location.bucket, Key=self._key(key))
        if etag:
            kwargs["IfMatch"] = etag
        what = f"deleting {self.url(key)}"
        try:
            self.client.delete_object(**kwargs)
            return True
        except ClientError as e:
            code = self._code(e)
            if code in ("PreconditionFailed", "412"):
                return False
            if code in ("404", "NoSuchKey"):
                return True
            if etag and code in ("NotImplemented", "501"):
                kwargs.pop("IfMatch")
                self._call(what, "delete_object", **kwargs)
                return True
            raise self._error(e, what) from e
        except BotoCoreError as e:
            raise self._error(e, what) from e
