"""Where objects live on the S3 API: ``s3://BUCKET[/PREFIX]`` URLs as an :class:`S3Location`,
and the boto3 client from the default credential chain (``docs/architecture.md`` §6.1)."""

from __future__ import annotations

import re
from dataclasses import dataclass

from services.errors import InvalidArgument

SCHEME = "s3://"

_BUCKET = re.compile(r"[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]")
_SEGMENT = re.compile(r"[A-Za-z0-9._=+-]+")


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
