"""JSON text from a request parsed in one place: every failure is ``InvalidArgument`` naming the
field, never a ``RecursionError`` from a document nested past the parser's depth."""

from __future__ import annotations

import json

from services.errors import InvalidArgument


def parse_json(text: str, what: str) -> object:
    """``text`` parsed as JSON. Raises ``InvalidArgument`` ("``what`` is not valid JSON: ...",
    or "... nests too deeply to parse")."""
    try:
        return json.loads(text)
    except ValueError as e:
        raise InvalidArgument(f"{what} is not valid JSON: {e}") from None
    except RecursionError:
        raise InvalidArgument(f"{what} nests too deeply to parse") from None
