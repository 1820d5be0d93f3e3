"""docs/security.md's RPC -> scope table is services/scopes.py's, and every RPC of every service has a scope."""

from __future__ import annotations

import re
from pathlib import Path

from services.proto import generation_pb2, kernel_cache_pb2, router_pb2, weights_pb2
from services.proto.triton import grpc_service_pb2
from services.scopes import METHOD_SCOPES, OPEN_METHODS, scope_of

DOC = Path(__file__).resolve().parents[2] / "docs" / "security.md"
_ROW = re.compile(r"^\| `([\w.]+)` \| `(\w+)` \| (\w+) \|$")


def _every_rpc() -> list[str]:
    out = []
    for module in (kernel_cache_pb2, weights_pb2, generation_pb2, router_pb2, grpc_service_pb2):
        for service in module.DESCRIPTOR.services_by_name.values():
            out += [f"/{service.full_name}/{m.name}" for m in service.methods]
    return out


def test_every_rpc_of_every_service_has_a_scope_or_is_open():
    rpcs = _every_rpc()
    assert len(rpcs) == 38
    for method in rpcs:
        assert method in METHOD_SCOPES or method in OPEN_METHODS, method
    assert set(METHOD_SCOPES) | OPEN_METHODS == set(rpcs)  # no stale entry either


def test_the_doc_table_is_the_scope_table():
    rows = {}
    for line in DOC.read_text().splitlines():
        m = _ROW.match(line)
        if m:
            rows[f"/{m.group(1)}/{m.group(2)}"] = m.group(3)
    expected = {m: (scope_of(m) or "open") for m in _every_rpc()}
    assert rows == expected
