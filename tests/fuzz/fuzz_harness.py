"""Sending fuzzed wire messages to any RPC of any service over one real channel, and the table of
statuses each service may answer with (test helper for ``tests/fuzz``).

A case is one RPC: a method of the service and the serialized requests
(:func:`proto_fuzz.wire_message`), sent as raw bytes so invalid UTF-8 and unknown fields reach
the server; a client stream may be cut off after some messages (the client cancels), a server
stream may be cancelled after its first answer (both ways the client cancels the call). :func:`run_case` returns the final status;
:func:`check_status` fails on one outside :data:`STATUSES`, and :func:`assert_serving` on a
server that no longer answers its health check.
"""

from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass

import grpc
from google.protobuf import message_factory
from grpc_health.v1 import health_pb2, health_pb2_grpc
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from proto_fuzz import garbage, wire_message

C = grpc.StatusCode
#: Every status a fuzzed request may get from each service. UNKNOWN and INTERNAL (a servicer
#: raised, or a request that did not parse) are crashes, DEADLINE_EXCEEDED a hang: never listed.
#: CANCELLED is allowed only for a case whose client cancelled (:func:`run_case`).
#: RESOURCE_EXHAUSTED: a message over the server's size limit, or (runner) a request that can
#: never fit; UNAVAILABLE: no runner to route to, or every stream slot (Weights: Prepare worker)
#: held; PERMISSION_DENIED (Weights): a source outside the service's model roots.
STATUSES: dict[str, frozenset[grpc.StatusCode]] = {
    "warmserve.v1.KernelCache": frozenset({C.OK, C.INVALID_ARGUMENT, C.NOT_FOUND, C.RESOURCE_EXHAUSTED}),
    "warmserve.v1.Weights": frozenset({C.OK, C.INVALID_ARGUMENT, C.NOT_FOUND, C.FAILED_PRECONDITION,
                                       C.RESOURCE_EXHAUSTED, C.PERMISSION_DENIED, C.UNAVAILABLE}),
    "warmserve.v1.Generation@runner": frozenset({C.OK, C.INVALID_ARGUMENT, C.RESOURCE_EXHAUSTED}),
    "warmserve.v1.Generation@router": frozenset({C.OK, C.INVALID_ARGUMENT, C.RESOURCE_EXHAUSTED,
                                                 C.UNAVAILABLE}),
    "warmserve.v1.RouterControl": frozenset({C.OK, C.INVALID_ARGUMENT}),
    "inference.GRPCInferenceService": frozenset({C.OK, C.INVALID_ARGUMENT, C.NOT_FOUND, C.RESOURCE_EXHAUSTED,
                                                 C.UNAVAILABLE, C.UNIMPLEMENTED}),
}

#: Seconds any one fuzzed RPC may take before it counts as a hang.
CASE_TIMEOUT_S = 10.0
#: Responses read from a server stream before the case cancels it (a cap on a case's cost).
MAX_STREAM_RESPONSES = 16


#: Cases per hypothesis example (:func:`batches`): hypothesis's own cost per example (its
#: choice tree, mutations) is shared by this many RPCs.
CASES_PER_EXAMPLE = 4


def batches(case_strategy: st.SearchStrategy[Case]) -> st.SearchStrategy[list[Case]]:
    """:data:`CASES_PER_EXAMPLE` cases, sent one after the other (each checked on its own)."""
    return st.lists(case_strategy, min_size=CASES_PER_EXAMPLE, max_size=CASES_PER_EXAMPLE)


def fuzz_settings(cases: int) -> settings:
    """Fixed, repeatable runs of ``cases`` generated cases in :func:`batches`: derandomized, no
    example database, no deadline per example. ``WARMSERVE_FUZZ_CASES`` overrides the count (a
    quicker or a longer local run)."""
    cases = int(os.environ.get("WARMSERVE_FUZZ_CASES", cases))
    return settings(max_examples=-(-cases // CASES_PER_EXAMPLE), derandomize=True, database=None, deadline=None, print_blob=False,
                    suppress_health_check=list(HealthCheck))


@dataclass(frozen=True)
class Case:
    """One fuzzed RPC: the method's descriptor, its serialized requests, and where the client
    stops: ``cut`` (client stream: cancel after sending that many; ``None``: close normally) and
    ``cancel_first`` (server stream: cancel after the first response)."""

    method: object
    requests: tuple[bytes, ...]
    cut: int | None = None
    cancel_first: bool = False

    @property
    def path(self) -> str:
        return f"/{self.method.containing_service.full_name}/{self.method.name}"

    def __repr__(self) -> str:  # what hypothesis prints for a failing case
        sizes = [len(r) for r in self.requests]
        return (f"Case({self.path}, requests={[r[:200] for r in self.requests]!r} sizes={sizes}, cut={self.cut}, "
                f"cancel_first={self.cancel_first})")


def request_strategy(method, hints: dict, *, depth: int = 3) -> st.SearchStrategy[bytes]:
    """One request of ``method``: a random message, or now and then bytes that are none."""
    return st.one_of(wire_message(method.input_type, depth=depth, hints=hints),
                     wire_message(method.input_type, depth=depth, hints=hints), garbage())


def cases(service, hints: dict, *, methods: tuple[str, ...] | None = None, extra: dict | None = None,
          max_stream: int = 6, often: dict[str, int] | None = None, depth: int = 3) -> st.SearchStrategy[Case]:
    """Cases over every method of ``service`` (a ``ServiceDescriptor``; ``methods`` narrows
    them); ``extra`` maps a method name to a strategy of its request tuples to mix in;
    ``often`` maps a method name to how many times as often as the others it is drawn;
    ``depth`` bounds the nesting of generic messages."""
    chosen = [m for m in service.methods if methods is None or m.name in methods]
    extra = extra or {}

    def for_method(m):
        one = request_strategy(m, hints, depth=depth)
        if m.client_streaming:
            reqs = st.lists(one, max_size=max_stream).map(tuple)
            if m.name in extra:
                reqs = st.one_of(reqs, extra[m.name])
            cut = st.one_of(st.none(), st.none(), st.integers(0, max_stream))
        else:
            reqs = one.map(lambda r: (r,))
            if m.name in extra:
                reqs = st.one_of(reqs, extra[m.name])
            cut = st.none()
        first = st.booleans() if m.server_streaming else st.just(False)
        return st.builds(Case, st.just(m), reqs, cut, first)

    often = often or {}
    return st.one_of([for_method(m) for m in chosen for _ in range(often.get(m.name, 1))])


def _response_class(method):
    return message_factory.GetMessageClass(method.output_type)


class _Feed:
    """A case's client stream: its requests, then -- when the case cuts it -- held open until the
    call is cancelled (:attr:`sent` tells the caller when every request before the cut was handed
    to gRPC)."""

    def __init__(self, case: Case) -> None:
        self.case = case
        self.sent = threading.Event()
        self.stop = threading.Event()

    def __iter__(self):
        cut = self.case.cut
        for i, r in enumerate(self.case.requests):
            if cut is not None and i >= cut:
                break
            yield r
        if cut is not None:
            self.sent.set()
            self.stop.wait(CASE_TIMEOUT_S)

    def cancel(self, call) -> None:
        """Cancel ``call`` once the requests before the cut are on their way (unless the server
        has answered already: then gRPC reads no more of them)."""
        deadline = time.monotonic() + CASE_TIMEOUT_S
        while not self.sent.wait(0.001) and not call.done() and time.monotonic() < deadline:
            pass
        time.sleep(0.001)  # let them reach the server
        call.cancel()
        self.stop.set()


def run_case(channel: grpc.Channel, case: Case, metadata=()) -> tuple[grpc.StatusCode, list, bool]:
    """Send ``case``; ``(final status, responses, whether the client cancelled)``."""
    m = case.method
    kw = dict(request_serializer=None, response_deserializer=_response_class(m).FromString)
    cut = case.cut is not None
    responses: list = []
    cancelled = cut
    try:
        if not m.client_streaming and not m.server_streaming:
            responses.append(channel.unary_unary(case.path, **kw)(case.requests[0], timeout=CASE_TIMEOUT_S,
                                                                  metadata=metadata))
        elif not m.client_streaming:
            call = channel.unary_stream(case.path, **kw)(case.requests[0], timeout=CASE_TIMEOUT_S, metadata=metadata)
            cancelled = _drain(call, responses, case.cancel_first)
        elif not m.server_streaming:
            feed = _Feed(case)
            future = channel.stream_unary(case.path, **kw).future(iter(feed), timeout=CASE_TIMEOUT_S,
                                                                  metadata=metadata)
            if cut:
                feed.cancel(future)
            try:
                responses.append(future.result())
            except grpc.FutureCancelledError:
                return C.CANCELLED, responses, True
        else:
            feed = _Feed(case)
            call = channel.stream_stream(case.path, **kw)(iter(feed), timeout=CASE_TIMEOUT_S, metadata=metadata)
            if cut:
                feed.cancel(call)
            cancelled = _drain(call, responses, case.cancel_first) or cut
    except grpc.RpcError as e:
        return e.code(), responses, cancelled
    return C.OK, responses, cancelled


def _drain(call, responses: list, cancel_first: bool) -> bool:
    """Read a server stream into ``responses``; cancel it after the first response when asked or
    after :data:`MAX_STREAM_RESPONSES`. True when this side cancelled."""
    for r in call:
        responses.append(r)
        if cancel_first or len(responses) >= MAX_STREAM_RESPONSES:
            call.cancel()
            return True
    return False


def check_status(service: str, case: Case, code: grpc.StatusCode, cancelled: bool, details: str = "") -> None:
    """Fail unless ``code`` is documented for ``service`` (CANCELLED only when the client cancelled)."""
    allowed = STATUSES[service] | ({C.CANCELLED} if cancelled else set())
    assert code in allowed, f"{case!r} got {code.name}, not one of {sorted(c.name for c in allowed)} {details}"


def assert_serving(channel: grpc.Channel, service: str = "") -> None:
    """The server still answers ``grpc.health.v1`` with SERVING."""
    stub = health_pb2_grpc.HealthStub(channel)
    got = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=5).status
    assert got == health_pb2.HealthCheckResponse.SERVING, got


def wait_until(predicate, timeout_s: float = 5.0) -> bool:
    """Poll ``predicate`` (every 2 ms, then 20 ms) until true or ``timeout_s`` seconds passed."""
    deadline = time.monotonic() + timeout_s
    pause = 0.002
    while not predicate():
        if time.monotonic() > deadline:
            return predicate()
        time.sleep(pause)
        pause = min(pause * 2, 0.02)
    return True


def fuzz_channel(address: str) -> grpc.Channel:
    """A plain channel with no client-side size limits (so an oversize message reaches the server)."""
    return grpc.insecure_channel(address, options=[("grpc.max_send_message_length", -1),
                                                   ("grpc.max_receive_message_length", -1),
                                                   ("grpc.enable_retries", 0)])
