"""What one kernel-cache request may carry, checked before anything is written
(``docs/architecture.md`` §6, "Limits"): keys (:mod:`kernel_cache_service.keys`), a known
format, a sha256 of 64 hex digits, and free text (``producer``, ``holder``) of at most
:data:`MAX_TEXT_BYTES` UTF-8 bytes, since every ``List`` answer carries each entry's producer.
Each failed check raises :class:`services.errors.InvalidArgument` (gRPC ``INVALID_ARGUMENT``)
with one sentence."""

from __future__ import annotations

from kernel_cache_service.entry import FORMATS
from kernel_cache_service.keys import validate_key
from services.errors import InvalidArgument

#: The most UTF-8 bytes a free-text field (producer, holder) may hold.
MAX_TEXT_BYTES = 256
#: Seconds a Publish may go without a message before it is cancelled (``--publish-idle-timeout``).
DEFAULT_PUBLISH_IDLE_S = 60.0
_HEX = frozenset("0123456789abcdef")


def check_text(value: str, what: str) -> str:
    """``value`` when it is at most :data:`MAX_TEXT_BYTES` UTF-8 bytes long; else raises
    ``InvalidArgument`` naming ``what`` and the limit."""
    size = len(value.encode("utf-8", "surrogatepass"))
    if size > MAX_TEXT_BYTES:
        raise InvalidArgument(f"{what} is {size} bytes long; the limit is {MAX_TEXT_BYTES} bytes, and nothing "
                              f"was stored")
    return value


def check_publish_header(name: str, fingerprint: str, *, fmt: str, producer: str, sha256: str | None) -> None:
    """Validate what a publish announces before any byte is stored: the key, ``fmt`` (one of
    :data:`~kernel_cache_service.entry.FORMATS`), ``producer`` (:func:`check_text`) and
    ``sha256`` (64 lowercase hex digits, or ``None`` when not announced). Raises
    ``InvalidArgument``."""
    validate_key(name, fingerprint)
    if fmt not in FORMATS:
        raise InvalidArgument(f"format must be one of {', '.join(FORMATS)}, got {fmt[:40]!r}")
    check_text(producer, "the producer")
    if sha256 is not None and (len(sha256) != 64 or not _HEX.issuperset(sha256)):
        raise InvalidArgument("sha256 must be 64 lowercase hex characters")
