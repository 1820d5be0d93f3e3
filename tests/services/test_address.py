"""services.address: the one host:port parser."""

from __future__ import annotations

import pytest

from services.address import format_address, parse_address
from services.errors import InvalidArgument


@pytest.mark.parametrize("text, expected", [
    ("127.0.0.1:50051", ("127.0.0.1", 50051)),
    ("runner-0:50061", ("runner-0", 50061)),
    ("[::1]:50051", ("::1", 50051)),
    ("[::]:1", ("::", 1)),
    ("localhost:65535", ("localhost", 65535)),
])
def test_parse_and_format_round_trip(text: str, expected: tuple[str, int]) -> None:
    assert parse_address(text) == expected
    assert format_address(*expected) == text


@pytest.mark.parametrize("text, problem", [
    ("localhost", "no port"),
    ("localhost:", "not a number"),
    ("localhost:0", "not a number in 1-65535"),
    ("localhost:65536", "not a number in 1-65535"),
    ("localhost:http", "not a number"),
    (":50051", "host is empty"),
    ("::1:50051", "IPv6 host goes in brackets"),
    ("[::1:50051", "malformed"),
    ("[]:50051", "malformed"),
])
def test_bad_addresses_say_why(text: str, problem: str) -> None:
    with pytest.raises(InvalidArgument, match="runner address must be host:port") as err:
        parse_address(text, what="runner address")
    assert problem in str(err.value) and repr(text) in str(err.value)


def test_empty_host_only_when_allowed() -> None:
    assert parse_address(":50061", allow_empty_host=True) == ("", 50061)
    assert parse_address("[::]:50061", allow_empty_host=True) == ("::", 50061)
