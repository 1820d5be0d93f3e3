"""What one kernel-cache request may carry, checked before anything is written
(``docs/architecture.md`` §6, "Limits"): keys (:mod:`kernel_cache_service.keys`), a known
format, a sha256 of 64 hex digits, and free text (``producer``, ``holder``) of at most
:data:`MAX_TEXT_BYTES` UTF-8 bytes, since every ``List`` answer carries each entry's producer;
a fingerprint parts record of at most :data:`MAX_PARTS_BYTES` bytes,
well formed and whose digest is the key's fingerprint (:func:`check_parts`).
Each failed check raises :class:`services.errors.InvalidArgument` (gRPC ``INVALID_ARGUMENT``)
with one sentence."""

from __future__ import annotations

from kernel_cache_service.entry import FORMATS
from kernel_cache_service.fingerprint import canonical_json, fingerprint_of, parse_parts
from kernel_cache_service.keys import validate_key
from services.errors import InvalidArgument

#: The most UTF-8 bytes a free-text field (producer, holder) may hold.
MAX_TEXT_BYTES = 256
#: The most bytes a fingerprint parts record may hold (a runner's is 4-8 KiB: containers over
#: ``fingerprint.MAX_VALUE_BYTES`` are kept as digests).
MAX_PARTS_BYTES = 64 << 10
#: The most parts-record bytes one ``List`` answer carries (``with_parts``); entries past it come
#: without their record (the gRPC message limit is 16 MiB).
MAX_LIST_PARTS_BYTES = 4 << 20
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


def check_parts(parts: str, name: str, fingerprint: str) -> str:
    """The canonical JSON of the parts record ``parts`` (``""`` for none) published as
    ``name``/``fingerprint``. Raises ``InvalidArgument`` (nothing is stored) when it is over
    :data:`MAX_PARTS_BYTES` bytes, is not a well-formed parts record
    (:func:`~kernel_cache_service.fingerprint.parse_parts`), names another program, or its digest
    is not ``fingerprint``."""
    if not parts:
        return ""
    size = len(parts.encode("utf-8", "surrogatepass"))
    if size > MAX_PARTS_BYTES:
        raise InvalidArgument(f"the fingerprint parts record is {size} bytes long; the limit is {MAX_PARTS_BYTES} "
                              "bytes, and nothing was stored")
    try:
        record = parse_parts(parts)
    except ValueError as e:
        raise InvalidArgument(f"{e}; nothing was stored") from None
    if record["name"] != name:
        raise InvalidArgument(f"the fingerprint parts record is {record['name'][:60]!r}'s, not {name!r}'s; "
                              "nothing was stored")
    if fingerprint_of(record) != fingerprint:
        raise InvalidArgument(f"the fingerprint parts record's digest is {fingerprint_of(record)[:12]}..., not the "
                              f"key's {fingerprint[:12]}...; nothing was stored")
    return canonical_json(record)


def check_publish_header(name: str, fingerprint: str, *, fmt: str, producer: str, sha256: str | None,
                         parts: str = "") -> str:
    """Validate what a publish announces before any byte is stored: the key, ``fmt`` (one of
    :data:`~kernel_cache_service.entry.FORMATS`), ``producer`` (:func:`check_text`), ``sha256``
    (64 lowercase hex digits, or ``None`` when not announced) and ``parts`` (:func:`check_parts`).
    Returns the canonical parts record (``""`` for none). Raises ``InvalidArgument``."""
    validate_key(name, fingerprint)
    if fmt not in FORMATS:
        raise InvalidArgument(f"format must be one of {', '.join(FORMATS)}, got {fmt[:40]!r}")
    check_text(producer, "the producer")
    if sha256 is not None and (len(sha256) != 64 or not _HEX.issuperset(sha256)):
        raise InvalidArgument("sha256 must be 64 lowercase hex characters")
    return check_parts(parts, name, fingerprint)
