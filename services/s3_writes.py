"""Conditional writes on the S3 API: an upload visible whole or not at all, by default only if
the key is free (``If-None-Match: *``), in one PUT or as a multipart upload whose completion
carries the condition (``docs/architecture.md`` §6.1, "publish")."""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from typing import BinaryIO

from services.errors import WarmserveError
from services.s3_errors import error_code
from services.s3_meta import object_metadata, sha256_b64

log = logging.getLogger(__name__)

#: Files larger than this (bytes) are uploaded in parts (a single PUT takes at most 5 GiB).
MULTIPART_BYTES = 256 << 20
#: Part size of a multipart upload in bytes (S3 wants >= 5 MiB for all but the last part).
PART_BYTES = 64 << 20
_MAX_PARTS = 10_000


class ConditionalWriter:
    """Writes to ``bucket`` through ``client`` (a boto3 S3 client); ``error(e, what)`` turns a
    boto3 exception into the :class:`WarmserveError` to raise. Keys are full object keys.
    Every write returns ``True`` when stored, ``False`` when ``if_absent`` and the key was taken;
    a failure raises naming ``what`` and leaves no object."""

    def __init__(self, client, bucket: str, error: Callable[[Exception, str], WarmserveError]) -> None:
        self.client, self.bucket, self._error = client, bucket, error

    def put(self, key: str, body: BinaryIO, size: int, sha: str, metadata: dict[str, str] | None,
            if_absent: bool, what: str) -> bool:
        """One PUT of ``size`` bytes from ``body`` (sha256 hex ``sha``, also sent as
        ``ChecksumSHA256``) with ``metadata`` plus ``size-bytes``/``sha256``."""
        kwargs = dict(Bucket=self.bucket, Key=key, Body=body, ContentLength=size,
                      Metadata=object_metadata(size, sha, metadata), ChecksumSHA256=sha256_b64(sha))
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
                code = error_code(e)
                if code in ("PreconditionFailed", "412"):
                    return False
                if code in ("ConditionalRequestConflict", "409") and n < 5:
                    time.sleep(0.05 * 2 ** n)
                    continue
                raise self._error(e, f"{what}; nothing was stored") from e
            except BotoCoreError as e:
                raise self._error(e, f"{what}; nothing was stored") from e
        return False  # pragma: no cover - the loop always returns or raises

    def call(self, what: str, method: str, **kwargs):
        """``client.<method>(**kwargs)``, a boto3 exception raised as ``error(e, what)``."""
        from botocore.exceptions import BotoCoreError, ClientError

        try:
            return getattr(self.client, method)(**kwargs)
        except (BotoCoreError, ClientError) as e:
            raise self._error(e, what) from e

    def put_multipart(self, key: str, f: BinaryIO, size: int, sha: str, metadata: dict[str, str] | None,
                      if_absent: bool, what: str, part_bytes: int) -> bool:
        """A multipart upload of ``size`` bytes from ``f`` in parts of ``part_bytes`` bytes (more
        when 10,000 parts would not hold it), made visible by one conditional
        ``CompleteMultipartUpload``; the parts are aborted when it does not complete."""
        from botocore.exceptions import BotoCoreError, ClientError

        part = max(part_bytes, math.ceil(size / _MAX_PARTS))
        upload = self.call(what, "create_multipart_upload", Bucket=self.bucket, Key=key,
                            Metadata=object_metadata(size, sha, metadata))
        upload_id = upload["UploadId"]
        done = False
        try:
            parts = []
            for number in range(1, math.ceil(size / part) + 1):
                data = f.read(part)
                r = self.call(f"{what}; nothing was stored", "upload_part", Bucket=self.bucket,
                               Key=key, UploadId=upload_id, PartNumber=number, Body=data)
                parts.append({"ETag": r["ETag"], "PartNumber": number})
            kwargs = dict(Bucket=self.bucket, Key=key, UploadId=upload_id, MultipartUpload={"Parts": parts})
            if if_absent:
                kwargs["IfNoneMatch"] = "*"
            stored = self._conditional(what, lambda: self.client.complete_multipart_upload(**kwargs))
            done = stored
            return stored
        finally:
            if not done:
                try:
                    self.client.abort_multipart_upload(Bucket=self.bucket, Key=key, UploadId=upload_id)
                except (BotoCoreError, ClientError) as e:  # the bucket's lifecycle rule cleans up what is left
                    log.warning("could not abort a multipart upload", extra={"key": key, "error": str(e)})
