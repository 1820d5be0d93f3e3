"""The runner side of ``RouterControl``: register with a router and keep the lease alive.

A runner whose Generation service is SERVING creates one :class:`RunnerRegistration` and calls
``start()``. A daemon thread then registers (retrying until the router answers), heartbeats every
granted ``heartbeat_interval_seconds`` with ``load_fn()``, and registers again whenever the router
answers ``known=false`` (it restarted, or the lease ran out). ``stop()`` ends the thread and sends
one last heartbeat with ``leaving`` set, so the router drains the runner (best effort; it needs
only the runner's own ``register`` scope and lease, not ``Drain``'s ``admin``); the lease then
simply expires.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

import grpc

from services.channel import ClientSecurity, open_channel
from services.errors import InvalidArgument
from services.proto import router_pb2, router_pb2_grpc

log = logging.getLogger(__name__)

#: Answers that mean the router will not take this registration as it is (logged as errors).
_REFUSALS = (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED,
             grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.RESOURCE_EXHAUSTED)

#: ``load_fn()`` returns these keys (counts of sequences and KV blocks); missing keys read as 0.
LOAD_KEYS = ("running", "waiting", "kv_blocks_used", "kv_blocks_total")


class RunnerRegistration:
    """Keeps one runner registered with the router at ``router_address``.

    - ``address``: ``host:port`` the router should dial; a wildcard host (``0.0.0.0:50061``)
      makes the router use the address it sees the registration come from.
    - ``lease_seconds``: lease to ask for (0 = the router's default).
    - ``retry_s``: seconds between attempts while the router cannot be reached.
    - ``rpc_timeout_s``: deadline of each control RPC.

    :attr:`registered` is set while a lease is held; :attr:`registrations` counts successful
    ``RegisterRunner`` calls (1 + re-registrations). Raises ``InvalidArgument`` for empty ids.
    """

    def __init__(self, router_address: str, *, runner_id: str, address: str, model: str,
                 max_num_seqs: int, load_fn: Callable[[], dict], lease_seconds: float = 0.0,
                 retry_s: float = 0.5, rpc_timeout_s: float = 2.0, security: ClientSecurity | None = None) -> None:
        if not router_address or not runner_id or not address:
            raise InvalidArgument("router address, runner id and runner address must be non-empty")
        if lease_seconds < 0 or retry_s <= 0 or rpc_timeout_s <= 0:
            raise InvalidArgument("lease_seconds must be >= 0 and retry/timeout > 0 seconds")
        self.router_address = router_address
        self._security = security
        self.runner_id = runner_id
        self.address = address
        self.model = model
        self.max_num_seqs = max_num_seqs
        self._load_fn = load_fn
        self._lease_seconds = lease_seconds
        self._retry_s = retry_s
        self._rpc_timeout_s = rpc_timeout_s
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._channel: grpc.Channel | None = None
        self._lease_id = ""
        self.registered = threading.Event()
        self.registrations = 0

    def start(self) -> None:
        """Start registering and heartbeating on a daemon thread (returns at once)."""
        if self._thread is not None:
            return
        self._channel = open_channel(self.router_address, security=self._security)
        self._thread = threading.Thread(target=self._loop, name="router-registration", daemon=True)
        self._thread.start()

    def stop(self, *, drain: bool = True) -> None:
        """Stop heartbeating; with ``drain``, tell the router this runner is leaving (it stops
        routing here)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if drain and self._channel is not None and self.registered.is_set():
            try:
                router_pb2_grpc.RouterControlStub(self._channel).Heartbeat(
                    router_pb2.HeartbeatRequest(runner_id=self.runner_id, lease_id=self._lease_id, leaving=True),
                    timeout=self._rpc_timeout_s)
            except grpc.RpcError as e:
                log.info("drain at router failed", extra={"router": self.router_address, "error": e.code().name})
        self.registered.clear()
        if self._channel is not None:
            self._channel.close()
            self._channel = None

    def _load(self) -> router_pb2.RunnerLoad:
        try:
            load = self._load_fn() or {}
        except Exception:
            log.exception("load_fn failed; reporting zero load")
            load = {}
        return router_pb2.RunnerLoad(**{k: int(load.get(k, 0)) for k in LOAD_KEYS})

    def _register(self, stub) -> float:
        resp = stub.RegisterRunner(router_pb2.RegisterRunnerRequest(
            runner_id=self.runner_id, address=self.address, model=self.model,
            max_num_seqs=self.max_num_seqs, lease_seconds=self._lease_seconds), timeout=self._rpc_timeout_s)
        self._lease_id = resp.lease_id
        self.registrations += 1
        self.registered.set()
        log.info("registered with router", extra={"router": self.router_address, "runner_id": self.runner_id,
                                                  "lease_s": resp.lease_seconds})
        return resp.heartbeat_interval_seconds

    def _loop(self) -> None:
        stub = router_pb2_grpc.RouterControlStub(self._channel)
        interval = 0.0
        while not self._stop.is_set():
            try:
                if not self.registered.is_set():
                    interval = self._register(stub)
                else:
                    resp = stub.Heartbeat(router_pb2.HeartbeatRequest(
                        runner_id=self.runner_id, lease_id=self._lease_id, load=self._load()),
                        timeout=self._rpc_timeout_s)
                    if not resp.known:
                        log.info("router forgot this runner; registering again",
                                 extra={"router": self.router_address})
                        self.registered.clear()
                        continue
            except grpc.RpcError as e:
                if e.code() in _REFUSALS:
                    log.error("router refused the registration", extra={"error": e.details(), "code": e.code().name})
                else:
                    log.info("router unreachable", extra={"router": self.router_address, "error": e.code().name})
                self._stop.wait(self._retry_s)
                continue
            self._stop.wait(max(interval, 0.05))
