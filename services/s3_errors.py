"""Errors of the object store: boto3/botocore exceptions as :class:`~services.errors.WarmserveError`
(``Unavailable`` for what may pass, ``FailedPrecondition`` for what will not), and
:class:`CorruptObject` (``docs/architecture.md`` §6.1)."""

from __future__ import annotations

from services.errors import FailedPrecondition, InvalidArgument, Unavailable, WarmserveError


class CorruptObject(WarmserveError):
    """An object's bytes do not match its recorded size or sha256, or its metadata is missing or
    garbled. ``key`` is the object's key (relative to the store), ``etag`` the version read."""

    def __init__(self, message: str, key: str = "", etag: str = "") -> None:
        super().__init__(message)
        self.key, self.etag = key, etag


def error_code(e: Exception) -> str:
    """S3's error code of a ``ClientError`` (its HTTP status when it has none), else ``""``."""
    from botocore.exceptions import ClientError

    if isinstance(e, ClientError):
        return str(e.response.get("Error", {}).get("Code", "")) or str(
            e.response.get("ResponseMetadata", {}).get("HTTPStatusCode", ""))
    return ""


def translate(e: Exception, what: str, where: str, bucket: str, endpoint: str) -> WarmserveError:
    """The error for a boto3/botocore exception ``e`` during ``what`` on ``where`` (the store's
    URL and endpoint), one sentence: missing credentials, a missing ``bucket``, denied access and
    other refusals are ``FailedPrecondition``; an unreachable ``endpoint``, timeouts, throttling
    and 5xx are ``Unavailable``; bad parameters ``InvalidArgument``."""
    from botocore import exceptions as bx

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
            return FailedPrecondition(f"{what}: bucket {bucket!r} does not exist at {endpoint}")
        if status == 403 or code in ("AccessDenied", "InvalidAccessKeyId", "SignatureDoesNotMatch"):
            return FailedPrecondition(f"{what}: access to {where} denied ({code}: {message})")
        if status >= 500 or code in ("SlowDown", "RequestTimeout", "ServiceUnavailable", "InternalError"):
            return Unavailable(f"{what}: the object store {where} is unavailable ({code}: {message})")
        return FailedPrecondition(f"{what}: the object store {where} refused ({code or status}: {message})")
    if isinstance(e, bx.BotoCoreError):
        return Unavailable(f"{what}: object store {where}: {e}")
    return WarmserveError(f"{what}: {e}")
