"""Validation of program keys (name, fingerprint), shared by the store, the daemon and the client.

A key part uses only ``[A-Za-z0-9._-]``, is 1..:data:`MAX_KEY_CHARS` characters long, never
contains ``..`` and is not ``.``; so it is always one safe path component (no traversal, no
separators) and the store can use it directly as a directory name. Bad keys raise
:class:`services.errors.InvalidArgument` (gRPC ``INVALID_ARGUMENT``, CLI exit 2).
"""

from __future__ import annotations

import re

from services.errors import InvalidArgument

MAX_KEY_CHARS = 200
_ALLOWED = re.compile(r"[A-Za-z0-9._-]+")


def validate_part(value: object, what: str) -> str:
    """Return ``value`` if it is a valid key part, else raise ``InvalidArgument`` naming ``what``."""
    if not isinstance(value, str) or not value:
        raise InvalidArgument(f"{what} must be a non-empty string")
    if len(value) > MAX_KEY_CHARS:
        raise InvalidArgument(f"{what} is {len(value)} characters long; the limit is {MAX_KEY_CHARS}")
    if not _ALLOWED.fullmatch(value):
        raise InvalidArgument(f"{what} {value[:40]!r} may only use letters, digits, '.', '_' and '-'")
    if ".." in value or value == ".":
        raise InvalidArgument(f"{what} {value!r} must not contain '..' or be '.'")
    return value


def validate_key(name: object, fingerprint: object) -> tuple[str, str]:
    """Validate both parts of a key; returns ``(name, fingerprint)``."""
    return validate_part(name, "name"), validate_part(fingerprint, "fingerprint")


def validate_prefix(prefix: object) -> str:
    """A ``List`` name prefix: empty, or what could start a valid name."""
    if prefix in ("", None):
        return ""
    if (not isinstance(prefix, str) or len(prefix) > MAX_KEY_CHARS or not _ALLOWED.fullmatch(prefix)
            or ".." in prefix):
        raise InvalidArgument(f"name prefix {str(prefix)[:40]!r} may only use letters, digits, '.', '_' "
                              f"and '-', without '..', up to {MAX_KEY_CHARS} characters")
    return prefix
