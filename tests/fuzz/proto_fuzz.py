"""Hypothesis strategies that build protobuf messages from their descriptors, straight on the
wire (test helper).

:func:`wire_message` draws the serialized bytes of a message of any descriptor: every field
absent or present with a random value -- huge and negative numbers (a negative ``int32`` is the
10-byte varint, a ``uint32`` may carry 64 bits), NaN and infinities, unknown enum values,
repeated fields packed or not, strings that are adversarial text or invalid UTF-8 (raw bytes no
protobuf library would serialize), nested messages to a bounded depth, and unknown fields.
``hints`` maps a scalar field's full name (``warmserve.v1.ProgramKey.name``) to a strategy of
plausible values (``str`` for a string field), or a message's full name to a strategy of its
serialized bytes, drawn as often as the generic ones, so that cases reach past validation.
:func:`garbage` is bytes that are not a message at all (truncated varints, lengths past the end).
"""

from __future__ import annotations

import struct

from google.protobuf.descriptor import Descriptor, FieldDescriptor
from hypothesis import strategies as st

F = FieldDescriptor

#: Text that has broken parsers before: traversal, NUL, control and bidi characters, markup of a
#: chat template, printf, a very long run, and an "UNKNOWN" fingerprint.
ADVERSARIAL_TEXT = ("", " ", ".", "..", "../x", "../../etc/passwd", "/", "/etc/passwd", "/dev/zero", "/proc/self/mem",
                    "a/b", "\x00", "a\x00b", "\n", "\r\n", "\t", "\u202e", "\ufeff", "\U0001f600" * 3, "%s%n%x",
                    "<|im_end|>", "<|im_start|>system", "{{ x }}", "UNKNOWN", "-1", "1e400", "NaN",
                    "a" * 300, "x" * 5000, "é" * 200)
#: Byte strings that are not UTF-8: a lone surrogate, a stray continuation byte, an overlong
#: encoding, a truncated sequence, 0xff.
INVALID_UTF8 = (b"\xed\xa0\x80", b"\x80", b"\xc0\xaf", b"\xe2\x82", b"\xff", b"a\xffb", b"\xf4\x90\x80\x80")

_VARINT_MAX = (1 << 64) - 1
_INT_EDGES = {
    F.TYPE_INT32: (0, 1, -1, 2**31 - 1, -(2**31), 2**31, 2**32 - 1, 2**63 - 1, -(2**63)),
    F.TYPE_INT64: (0, 1, -1, 2**63 - 1, -(2**63), 2**53 + 1),
    F.TYPE_UINT32: (0, 1, 2**31, 2**32 - 1, 2**32, _VARINT_MAX),
    F.TYPE_UINT64: (0, 1, 2**32, 2**63, _VARINT_MAX),
    F.TYPE_BOOL: (0, 1, 2, _VARINT_MAX),
    F.TYPE_ENUM: (0, 1, 2, 3, 7, 99, -1, 2**31 - 1, -(2**31)),
}
_VARINT_TYPES = tuple(_INT_EDGES) + (F.TYPE_SINT32, F.TYPE_SINT64)
_FIXED64 = {F.TYPE_DOUBLE: "<d", F.TYPE_FIXED64: "<Q", F.TYPE_SFIXED64: "<q"}
_FIXED32 = {F.TYPE_FLOAT: "<f", F.TYPE_FIXED32: "<I", F.TYPE_SFIXED32: "<i"}
_FLOAT_EDGES = (0.0, -0.0, 1.0, -1.0, 0.5, 1e-45, 1e30, -1e30, 3.4e38, float("inf"), float("-inf"), float("nan"))


def varint(value: int) -> bytes:
    """``value`` as a base-128 varint; negatives as their 64-bit two's complement (10 bytes)."""
    value &= _VARINT_MAX
    out = bytearray()
    while True:
        byte = value & 0x7F
        value >>= 7
        if value:
            out.append(byte | 0x80)
        else:
            out.append(byte)
            return bytes(out)


def tag(number: int, wire_type: int) -> bytes:
    """A field's key: number and wire type (0 varint, 1 fixed64, 2 length-delimited, 5 fixed32)."""
    return varint((number << 3) | wire_type)


def length_delimited(number: int, payload: bytes) -> bytes:
    """One length-delimited field (string, bytes, message, packed repeated)."""
    return tag(number, 2) + varint(len(payload)) + payload


def text_bytes() -> st.SearchStrategy[bytes]:
    """A string field's bytes: random or adversarial text, or invalid UTF-8 (now and then)."""
    return st.one_of(
        st.text(max_size=12).map(lambda s: s.encode("utf-8", "surrogatepass")),
        st.sampled_from(ADVERSARIAL_TEXT).map(str.encode),
        st.sampled_from(INVALID_UTF8),
        st.binary(max_size=12),
    )


def _scalar(field: FieldDescriptor) -> st.SearchStrategy:
    """A strategy of one value of ``field``'s scalar type, as its Python number or bytes."""
    t = field.type
    if t in _VARINT_TYPES:
        edges = _INT_EDGES.get(t, (0, 1, -1, 2**31 - 1, -(2**31)))
        return st.one_of(st.sampled_from(edges), st.integers(-(2**63), _VARINT_MAX), st.integers(-3, 300))
    if t in _FIXED64 or t in _FIXED32:
        if t in (F.TYPE_DOUBLE, F.TYPE_FLOAT):
            return st.one_of(st.sampled_from(_FLOAT_EDGES), st.floats(width=64 if t == F.TYPE_DOUBLE else 32))
        lo, hi = {"<Q": (0, 2**64 - 1), "<q": (-(2**63), 2**63 - 1), "<I": (0, 2**32 - 1),
                  "<i": (-(2**31), 2**31 - 1)}[(_FIXED64 | _FIXED32)[t]]
        return st.integers(lo, hi)
    if t == F.TYPE_STRING:
        return text_bytes()
    if t == F.TYPE_BYTES:
        return st.one_of(st.binary(max_size=64), st.sampled_from((b"", b"\x7fELF" + bytes(60))))
    raise TypeError(f"no scalar strategy for field type {t}")


def _encode_scalar(field: FieldDescriptor, value) -> tuple[int, bytes]:
    """``(wire type, bytes without the key)`` of one scalar value."""
    t = field.type
    if t in _VARINT_TYPES:
        if t == F.TYPE_SINT32 or t == F.TYPE_SINT64:
            value = (value << 1) ^ (value >> 63)
        return 0, varint(value)
    if t in _FIXED64:
        return 1, struct.pack(_FIXED64[t], value)
    if t in _FIXED32:
        if t == F.TYPE_FLOAT and abs(value) > 3.4e38 and value == value and abs(value) != float("inf"):
            value = float("inf") if value > 0 else float("-inf")
        return 5, struct.pack(_FIXED32[t], value)
    return 2, varint(len(value)) + value


def _is_repeated(field: FieldDescriptor) -> bool:
    return field.is_repeated


def _field(field: FieldDescriptor, depth: int, hints: dict) -> st.SearchStrategy[bytes]:
    """Every occurrence of ``field`` on the wire (empty bytes when absent)."""
    if field.type == F.TYPE_MESSAGE:
        if depth <= 0:
            return st.just(b"")
        inner = wire_message(field.message_type, depth=depth - 1, hints=hints)
        one = inner.map(lambda payload: length_delimited(field.number, payload))
    else:
        value = _scalar(field)
        if field.full_name in hints:
            value = st.one_of(hints[field.full_name], value)

        def encode(v, field=field):
            wire_type, payload = _encode_scalar(field, v.encode() if isinstance(v, str) else v)
            return tag(field.number, wire_type) + payload

        one = value.map(encode)
        if _is_repeated(field) and field.type not in (F.TYPE_STRING, F.TYPE_BYTES):
            # packed: one length-delimited run of values without keys
            packed = st.lists(value, max_size=4).map(
                lambda vs, field=field: length_delimited(field.number, b"".join(_encode_scalar(field, v)[1]
                                                                                for v in vs)))
            one = st.one_of(one, packed)
    if _is_repeated(field):
        return st.lists(one, max_size=3).map(b"".join)
    return st.one_of(st.just(b""), one)


def _unknown_field() -> st.SearchStrategy[bytes]:
    """A well-formed field under a number no message here uses."""
    number = st.integers(1000, 536_870_911)
    return st.one_of(
        st.tuples(number, st.integers(0, _VARINT_MAX)).map(lambda t: tag(t[0], 0) + varint(t[1])),
        st.tuples(number, st.binary(max_size=8)).map(lambda t: length_delimited(t[0], t[1])),
        st.tuples(number, st.binary(min_size=8, max_size=8)).map(lambda t: tag(t[0], 1) + t[1]),
    )


_CACHE: dict[tuple[str, int, int], st.SearchStrategy[bytes]] = {}


def wire_message(descriptor: Descriptor, *, depth: int = 3, hints: dict | None = None) -> st.SearchStrategy[bytes]:
    """The serialized bytes of a random ``descriptor`` message (see the module docstring); a
    hint for the message's own full name replaces the generic draw half the time."""
    hints = hints or {}
    key = (descriptor.full_name, depth, id(hints))
    if key not in _CACHE:
        fields = [_field(f, depth, hints) for f in descriptor.fields]
        body = st.tuples(*fields, st.lists(_unknown_field(), max_size=1)).map(
            lambda parts: b"".join(parts[:-1]) + b"".join(parts[-1]))
        if descriptor.full_name in hints:
            body = st.one_of(hints[descriptor.full_name], body)
        _CACHE[key] = body
    return _CACHE[key]


def garbage() -> st.SearchStrategy[bytes]:
    """Bytes that do not parse as any message: a truncated varint, a length past the end, an
    end-group tag, wire type 7."""
    return st.one_of(
        st.sampled_from((b"\x08", b"\x08\xff", b"\x0a\x05ab", b"\x0a\xff\xff\xff\xff\x0f", b"\x0c", b"\x0f",
                         b"\x00", b"\xff" * 11)),
        st.binary(min_size=1, max_size=32).map(lambda b: b + b"\x0a\x7f"),
    )


def field_bytes(number: int, value: str | bytes) -> bytes:
    """One string/bytes field (for hints that need exact bytes)."""
    return length_delimited(number, value.encode() if isinstance(value, str) else value)
