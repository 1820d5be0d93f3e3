"""Router settings, validated at construction."""

from __future__ import annotations

from dataclasses import dataclass

from services.address import parse_address
from services.errors import InvalidArgument

#: The routing policies (:mod:`router_service.policy`), named as on the command line; each is a
#: ``RoutingPolicy`` enum value's name without its ``ROUTING_POLICY_`` prefix, in lower case with
#: dashes (``ROUTING_POLICY_LEAST_OUTSTANDING`` is ``least-outstanding``).
POLICY_NAMES = ("least-outstanding", "round-robin", "prefix-affinity")
DEFAULT_POLICY = "least-outstanding"


@dataclass(frozen=True)
class RouterConfig:
    """Everything the router core needs; times in seconds. Raises ``InvalidArgument`` when invalid.

    - ``static_runners``: ``host:port`` addresses given by ``--runner``; admitted after their first
      successful health check, never expire.
    - ``policy``: the default when a request says ``ROUTING_POLICY_UNSPECIFIED``.
    - ``default_lease_s``: lease granted to a runner that asks for 0; requests are clamped to
      ``[min_lease_s, max_lease_s]``. Runners are told to heartbeat every lease / 3.
    - ``health_interval_s`` / ``health_timeout_s``: period and per-check deadline of the
      grpc.health.v1 checks; ``eject_after`` consecutive failures mark a runner UNHEALTHY and
      ``readmit_after`` consecutive successes make it READY again.
    - ``max_attempts``: runners tried per request (a retry happens only before the first token).
    - ``first_token_timeout_s``: a runner that streams nothing the client can use (a token, text
      or a finish) within this many seconds of being sent a request is treated as failed: the call
      is cancelled, the runner ejected and the request retried elsewhere (a frozen runner, e.g.
      SIGSTOP or a stuck host, would otherwise hold it until its lease or the client's deadline
      ran out); 0 turns it off. Set it above the longest honest prefill.
    - ``prefix_block_tokens`` / ``prefix_block_bytes``: how much of the prompt keys prefix affinity
      (token ids, or UTF-8 bytes of text / rendered chat); ``ring_replicas``: virtual nodes per
      runner on the consistent-hash ring.
    - ``served_model_name``: the model name the KServe v2 door (:mod:`kserve_service`)
      answers to, as vLLM's ``--served-model-name``; ``""`` derives it from the runners' model
      source (:func:`services.model_name.served_model_name`). Requests may also name the source.
    - ``admission_timeout_s``: deadline of each call of a registering runner's admission check
      (health, ``ModelInfo``: :mod:`router_service.admission`); one that does not answer in time
      stays UNHEALTHY until the health checker verifies it.
    - ``max_runners``: registered runners the table holds at most; one more registration of a new
      id is ``RESOURCE_EXHAUSTED`` (static runners do not count).
    - ``max_stream_requests``: requests in flight at once on one KServe ``ModelStreamInfer``
      stream (which takes one stream slot); one more is refused, in the stream, as
      :class:`~services.errors.Overloaded` (:mod:`kserve_service.stream`).
    """

    static_runners: tuple[str, ...] = ()
    policy: str = DEFAULT_POLICY
    default_lease_s: float = 10.0
    min_lease_s: float = 0.5
    max_lease_s: float = 300.0
    health_interval_s: float = 1.0
    health_timeout_s: float = 1.0
    eject_after: int = 3
    readmit_after: int = 1
    max_attempts: int = 3
    first_token_timeout_s: float = 30.0
    prefix_block_tokens: int = 16
    prefix_block_bytes: int = 64
    ring_replicas: int = 64
    served_model_name: str = ""
    max_runners: int = 64
    admission_timeout_s: float = 3.0
    max_stream_requests: int = 8

    def __post_init__(self) -> None:
        if self.served_model_name != self.served_model_name.strip():
            raise InvalidArgument(f"the served model name {self.served_model_name!r} has leading or trailing "
                                  f"whitespace")
        if self.policy not in POLICY_NAMES:
            raise InvalidArgument(f"unknown routing policy {self.policy!r}; expected one of {', '.join(POLICY_NAMES)}")
        for addr in self.static_runners:
            parse_address(addr, what="runner address")
        if len(set(self.static_runners)) != len(self.static_runners):
            raise InvalidArgument("a static runner address is given twice")
        if not 0 < self.min_lease_s <= self.default_lease_s <= self.max_lease_s:
            raise InvalidArgument(
                f"leases must satisfy 0 < min ({self.min_lease_s}) <= default ({self.default_lease_s}) "
                f"<= max ({self.max_lease_s}) seconds")
        if self.health_interval_s <= 0 or self.health_timeout_s <= 0 or self.admission_timeout_s <= 0:
            raise InvalidArgument("health interval, health timeout and admission timeout must be > 0 seconds")
        if self.first_token_timeout_s < 0:
            raise InvalidArgument(f"first-token timeout must be >= 0 seconds (0: off), got {self.first_token_timeout_s}")
        for name in ("eject_after", "readmit_after", "max_attempts", "prefix_block_tokens",
                     "prefix_block_bytes", "ring_replicas", "max_stream_requests", "max_runners"):
            if getattr(self, name) < 1:
                raise InvalidArgument(f"{name} must be >= 1, got {getattr(self, name)}")
