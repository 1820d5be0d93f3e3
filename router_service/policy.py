"""Routing policies: which READY runner gets a request.

- ``least-outstanding`` (default): the runner with the fewest requests in flight through this
  router; ties go to the lower reported load (running + waiting sequences), then rotate.
- ``round-robin``: runners in id order, one after another.
- ``prefix-affinity``: a consistent-hash ring (Karger et al. 1997) keyed by the request's first
  prompt block, so requests sharing a prefix land on the same runner (and its warm KV / prefix
  cache); when a runner leaves, only the keys it owned move. Each runner has ``ring_replicas``
  virtual nodes at ``blake2b(runner_id#i)``; a key goes to the first node clockwise whose runner
  is a candidate.

Policies are called by :meth:`router_service.registry.RunnerRegistry.acquire` under its lock,
with the READY candidates sorted by id (never empty).
"""

from __future__ import annotations

import bisect
import hashlib
import itertools
import struct
import threading
from collections.abc import Sequence

from router_service.config import POLICY_NAMES, RouterConfig
from router_service.registry import Chooser, Runner
from services.errors import InvalidArgument
from services.proto import generation_pb2


def prompt_block_key(request: generation_pb2.GenerateRequest, *, block_tokens: int, block_bytes: int) -> bytes:
    """The bytes that key prefix affinity: the first ``block_tokens`` token ids (int32 little
    endian), or the first ``block_bytes`` UTF-8 bytes of the text, or of the chat rendered as
    ``role NUL content NUL ...``. The prompt kind is part of the key. Empty prompt -> ``b""``."""
    kind = request.WhichOneof("prompt")
    if kind == "token_ids":
        ids = list(request.token_ids.ids[:block_tokens])
        return b"T" + struct.pack(f"<{len(ids)}i", *ids)
    if kind == "text":
        return b"X" + request.text.encode()[:block_bytes]
    if kind == "chat":
        rendered = b"".join(m.role.encode() + b"\0" + m.content.encode() + b"\0" for m in request.chat.messages)
        return b"C" + rendered[:block_bytes]
    return b""


def _hash64(data: bytes) -> int:
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "big")


class LeastOutstanding:
    """Fewest in-flight requests; ties by reported load, then rotating."""

    name = "least-outstanding"

    def __init__(self) -> None:
        self._turn = itertools.count()

    def chooser(self, request: generation_pb2.GenerateRequest) -> Chooser:
        """The choice function for ``request`` (this policy ignores the prompt)."""
        def choose(candidates: Sequence[Runner]) -> Runner:
            turn, n = next(self._turn), len(candidates)
            return min(enumerate(candidates), key=lambda ic: (
                ic[1].outstanding, ic[1].load.running + ic[1].load.waiting, (ic[0] - turn) % n))[1]

        return choose


class RoundRobin:
    """Candidates in id order, one after another."""

    name = "round-robin"

    def __init__(self) -> None:
        self._turn = itertools.count()

    def chooser(self, request: generation_pb2.GenerateRequest) -> Chooser:
        """The choice function for ``request`` (this policy ignores the prompt)."""
        def choose(candidates: Sequence[Runner]) -> Runner:
            return candidates[next(self._turn) % len(candidates)]

        return choose


class PrefixAffinity:
    """Consistent hash of the first prompt block onto a ring of runner virtual nodes."""

    name = "prefix-affinity"

    def __init__(self, *, replicas: int, block_tokens: int, block_bytes: int) -> None:
        self._replicas = replicas
        self._block_tokens = block_tokens
        self._block_bytes = block_bytes
        self._lock = threading.Lock()
        self._ring_ids: tuple[str, ...] = ()
        self._ring: list[tuple[int, str]] = []

    def _ring_for(self, ids: tuple[str, ...]) -> list[tuple[int, str]]:
        with self._lock:
            if ids != self._ring_ids:
                self._ring = sorted((_hash64(f"{rid}#{i}".encode()), rid)
                                    for rid in ids for i in range(self._replicas))
                self._ring_ids = ids
            return self._ring

    def owner(self, key: bytes, runner_ids: Sequence[str]) -> str:
        """The runner id that owns ``key`` on the ring built over ``runner_ids`` (non-empty)."""
        ring = self._ring_for(tuple(sorted(runner_ids)))
        i = bisect.bisect_left(ring, (_hash64(key), ""))
        return ring[i % len(ring)][1]

    def chooser(self, request: generation_pb2.GenerateRequest) -> Chooser:
        """The choice function for ``request``: the owner of its first prompt block."""
        key = prompt_block_key(request, block_tokens=self._block_tokens, block_bytes=self._block_bytes)

        def choose(candidates: Sequence[Runner]) -> Runner:
            owner = self.owner(key, [r.runner_id for r in candidates])
            return next(r for r in candidates if r.runner_id == owner)

        return choose


class PolicySet:
    """The three policies, and the choice between them per request."""

    #: ``RoutingPolicy`` enum value -> policy name (``ROUTING_POLICY_LEAST_OUTSTANDING`` ->
    #: ``least-outstanding``).
    _BY_ENUM = {generation_pb2.RoutingPolicy.Value("ROUTING_POLICY_" + name.upper().replace("-", "_")): name
                for name in POLICY_NAMES}

    def __init__(self, config: RouterConfig) -> None:
        policies = (LeastOutstanding(), RoundRobin(),
                    PrefixAffinity(replicas=config.ring_replicas, block_tokens=config.prefix_block_tokens,
                                   block_bytes=config.prefix_block_bytes))
        self._policies = {policy.name: policy for policy in policies}
        assert set(self._policies) == set(POLICY_NAMES), "POLICY_NAMES and the policy classes disagree"
        self.default = config.policy

    def for_request(self, request: generation_pb2.GenerateRequest) -> Chooser:
        """The chooser for ``request.routing`` (UNSPECIFIED -> the default). Raises
        ``InvalidArgument`` for a value outside the enum."""
        routing = request.routing
        if routing == generation_pb2.ROUTING_POLICY_UNSPECIFIED:
            name = self.default
        elif routing in self._BY_ENUM:
            name = self._BY_ENUM[routing]
        else:
            raise InvalidArgument(f"unknown routing policy value {routing}; expected 0-3")
        return self._policies[name].chooser(request)

    def default_chooser(self) -> Chooser:
        """The default policy's chooser for a request without a prompt (e.g. ModelInfo)."""
        return self._policies[self.default].chooser(generation_pb2.GenerateRequest())
