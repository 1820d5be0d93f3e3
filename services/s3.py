"""Object storage on the S3 API (``boto3``), shared by the kernel cache and the weight service:
:class:`ObjectStore`, one location (bucket + key prefix) with the few streaming operations both
build on. Credentials, conditional writes, verification and errors: ``docs/architecture.md`` §6.1.
"""

from __future__ import annotations

import hashlib
import io
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import BinaryIO

from services.errors import InvalidArgument, WarmserveError
from services.s3_errors import CorruptObject, error_code, translate
from services.s3_location import S3Location, make_client, parse_s3_url
from services.s3_meta import CHUNK_BYTES, ObjectHead, hash_stream, head_from_response, mismatch
from services.s3_writes import MULTIPART_BYTES, PART_BYTES, ConditionalWriter


class ObjectStore:
    """Objects under ``location`` (keys given to the methods are relative to its prefix).

    ``client``: a boto3 S3 client (default :func:`make_client`). ``multipart_bytes`` /
    ``part_bytes``: above which size a file is uploaded in parts, and the part size (bytes).
    Thread-safe (boto3 clients are). Methods raise ``Unavailable`` / ``FailedPrecondition`` as
    :func:`services.s3_errors.translate` says.
    """

    def __init__(self, location: S3Location, client=None, *, multipart_bytes: int = MULTIPART_BYTES,
                 part_bytes: int = PART_BYTES) -> None:
        self.location = location
        self.client = client if client is not None else make_client()
        self.multipart_bytes, self.part_bytes = multipart_bytes, part_bytes
        self._writer = ConditionalWriter(self.client, location.bucket, self._error)

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
        return translate(e, what, f"{self.url()} at {self.endpoint}", self.location.bucket, self.endpoint)

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
            if error_code(e) in ("404", "NoSuchBucket", "NotFound"):
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
            if error_code(e) in ("404", "NoSuchKey", "NotFound"):
                return None
            raise self._error(e, f"looking up {self.url(key)}") from e
        except BotoCoreError as e:
            raise self._error(e, f"looking up {self.url(key)}") from e
        return head_from_response(key, r)

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
            if error_code(e) in ("404", "NoSuchKey", "NotFound"):
                return None
            raise self._error(e, what) from e
        except BotoCoreError as e:
            raise self._error(e, what) from e
        head = head_from_response(key, r)
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
        problem = mismatch(head, size, sha.hexdigest(), expect_size, expect_sha256)
        if problem:
            raise CorruptObject(f"{self.url(key)} is corrupt: {problem}", key, head.etag)
        return head

    def get_bytes(self, key: str, *, limit: int = 16 << 20) -> tuple[ObjectHead, bytes] | None:
        """A small object (at most ``limit`` bytes, e.g. a manifest) verified like
        :meth:`download`; ``None`` when absent. ``CorruptObject`` also when it is larger."""
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
        sha = hashlib.sha256(data).hexdigest()
        return self._writer.put(self._key(key), io.BytesIO(data), len(data), sha, metadata, if_absent,
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
                return self._writer.put_multipart(self._key(key), f, size, sha256, metadata, if_absent, what,
                                                  self.part_bytes)
            return self._writer.put(self._key(key), f, size, sha256, metadata, if_absent, what)

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
            code = error_code(e)
            if code in ("PreconditionFailed", "412"):
                return False
            if code in ("404", "NoSuchKey"):
                return True
            if etag and code in ("NotImplemented", "501"):
                kwargs.pop("IfMatch")
                self._writer.call(what, "delete_object", **kwargs)
                return True
            raise self._error(e, what) from e
        except BotoCoreError as e:
            raise self._error(e, what) from e
