"""Routing policies, checked against first principles (counts, ring consistency, fairness)."""

from __future__ import annotations

import collections

import pytest

from router_service.config import RouterConfig
from router_service.policy import PolicySet, PrefixAffinity, prompt_block_key
from router_service.registry import Runner, RunnerLoad, RunnerState
from services.errors import InvalidArgument
from services.proto import generation_pb2


def _runners(*specs: tuple[str, int]) -> list[Runner]:
    return [Runner(runner_id=rid, address=f"127.0.0.1:{1000 + i}", static=False, state=RunnerState.READY,
                   outstanding=out) for i, (rid, out) in enumerate(specs)]


def _text(text: str, routing=generation_pb2.ROUTING_POLICY_UNSPECIFIED) -> generation_pb2.GenerateRequest:
    return generation_pb2.GenerateRequest(text=text, routing=routing)


def test_least_outstanding_picks_the_idlest_runner() -> None:
    policies = PolicySet(RouterConfig())
    choose = policies.for_request(_text("hi"))
    assert choose(_runners(("a", 3), ("b", 1), ("c", 2))).runner_id == "b"


def test_least_outstanding_breaks_ties_by_reported_load_then_rotates() -> None:
    policies = PolicySet(RouterConfig())
    runners = _runners(("a", 1), ("b", 1))
    runners[0].load = RunnerLoad(running=4)
    assert policies.for_request(_text("x"))(runners).runner_id == "b"
    equal = _runners(("a", 0), ("b", 0), ("c", 0))
    picks = [policies.for_request(_text("x"))(equal).runner_id for _ in range(6)]
    assert collections.Counter(picks) == {"a": 2, "b": 2, "c": 2}


def test_round_robin_cycles_in_id_order() -> None:
    policies = PolicySet(RouterConfig())
    runners = _runners(("a", 5), ("b", 0), ("c", 9))
    req = _text("x", generation_pb2.ROUTING_POLICY_ROUND_ROBIN)
    assert [policies.for_request(req)(runners).runner_id for _ in range(6)] == ["a", "b", "c", "a", "b", "c"]


def test_unknown_routing_value_is_invalid_argument() -> None:
    with pytest.raises(InvalidArgument, match="unknown routing policy value 7"):
        PolicySet(RouterConfig()).for_request(_text("x", 7))


def test_unknown_default_policy_is_rejected() -> None:
    with pytest.raises(InvalidArgument, match="unknown routing policy 'fastest'"):
        RouterConfig(policy="fastest")


def test_prompt_block_key_uses_only_the_first_block() -> None:
    a = generation_pb2.GenerateRequest(token_ids=generation_pb2.TokenIds(ids=list(range(16)) + [1, 2]))
    b = generation_pb2.GenerateRequest(token_ids=generation_pb2.TokenIds(ids=list(range(16)) + [9]))
    c = generation_pb2.GenerateRequest(token_ids=generation_pb2.TokenIds(ids=[1] + list(range(1, 16))))
    key = lambda r: prompt_block_key(r, block_tokens=16, block_bytes=64)  # noqa: E731
    assert key(a) == key(b) == b"T" + b"".join(i.to_bytes(4, "little") for i in range(16))
    assert key(a) != key(c)
    long = "s" * 64
    assert key(_text(long + "tail one")) == key(_text(long + "tail two")) == b"X" + long.encode()
    chat = generation_pb2.GenerateRequest(chat=generation_pb2.ChatPrompt(
        messages=[generation_pb2.ChatMessage(role="user", content="hello")]))
    assert key(chat) == b"Cuser\0hello\0"


def test_prefix_affinity_is_sticky_and_consistent() -> None:
    ring = PrefixAffinity(replicas=64, block_tokens=16, block_bytes=64)
    ids = ["r0", "r1", "r2"]
    keys = [f"prompt-{i}".encode() for i in range(600)]
    owners = {k: ring.owner(k, ids) for k in keys}
    # Sticky: the same key always maps to the same runner.
    assert all(ring.owner(k, ids) == owners[k] for k in keys[:50])
    # Balanced enough: with 64 virtual nodes each runner owns a fair share (expected 1/3 each).
    counts = collections.Counter(owners.values())
    assert set(counts) == set(ids) and min(counts.values()) > 600 * 0.2
    # Consistent: removing r1 moves only the keys r1 owned.
    after = {k: ring.owner(k, ["r0", "r2"]) for k in keys}
    moved = [k for k in keys if after[k] != owners[k]]
    assert moved and all(owners[k] == "r1" for k in moved)
    assert len(moved) == counts["r1"]


def test_prefix_affinity_chooser_routes_shared_prefixes_together() -> None:
    policies = PolicySet(RouterConfig(prefix_block_bytes=8))
    runners = _runners(("a", 0), ("b", 0), ("c", 0), ("d", 0))
    picks = {policies.for_request(_text(f"SHAREDPF then {i}", generation_pb2.ROUTING_POLICY_PREFIX_AFFINITY))(runners).runner_id
             for i in range(20)}
    assert len(picks) == 1
    spread = {policies.for_request(_text(f"{i:08d}", generation_pb2.ROUTING_POLICY_PREFIX_AFFINITY))(runners).runner_id
              for i in range(40)}
    assert len(spread) == 4
