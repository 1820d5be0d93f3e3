"""The router's table of runners: static ones, leased registrations, health and load.

A runner is either *static* (``--runner ADDR``; its id is its address; it never expires and is
admitted after its first successful health check) or *registered* (``RegisterRunner``; it holds a
lease renewed by ``Heartbeat`` and is dropped when the lease runs out). States:

- ``READY``: requests may be routed to it;
- ``UNHEALTHY``: ejected after ``eject_after`` consecutive failures (health checks or failed
  calls), or a static runner not yet seen healthy; ``readmit_after`` consecutive successes
  make it READY again;
- ``DRAINING``: no new requests; in-flight ones finish; only a new registration undoes it.

A registered runner is READY only once *verified* (health SERVING and its ``ModelInfo`` model
matching: :mod:`router_service.admission`); until then it is UNHEALTHY ``not yet verified``.
Who may take a registered id while its lease is live (:meth:`RunnerRegistry.check_claim`): with
auth on, only the identity that registered it (``services.auth.caller``), from any address (a
restarted pod); with auth off, anyone from the same address, and from another address only once
the holder is not READY. The table holds at most ``max_runners`` registered runners.

Every method is thread-safe (one lock). Picking a runner and counting it as busy happen under the
same lock (:meth:`RunnerRegistry.acquire`), so concurrent requests see each other's choices.
Times are seconds on the injected monotonic ``clock``.
"""

from __future__ import annotations

import enum
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace

from router_service.config import RouterConfig
from services.address import parse_address
from services.errors import FailedPrecondition, InvalidArgument, PermissionDenied, ResourceExhausted


class RunnerState(enum.Enum):
    """A runner's routing state (see the module docstring)."""
    READY = "READY"
    UNHEALTHY = "UNHEALTHY"
    DRAINING = "DRAINING"


@dataclass(frozen=True)
class RunnerLoad:
    """Load a runner reports in its heartbeat: sequences running / waiting, KV blocks used / total."""

    running: int = 0
    waiting: int = 0
    kv_blocks_used: int = 0
    kv_blocks_total: int = 0


@dataclass
class Runner:
    """One runner as the router sees it. Mutated only by :class:`RunnerRegistry` under its lock;
    everything handed out of the registry is a copy (:meth:`RunnerRegistry.snapshot`) except the
    live objects passed to a policy inside :meth:`RunnerRegistry.acquire`."""

    runner_id: str
    address: str
    static: bool
    state: RunnerState
    model: str = ""
    max_num_seqs: int = 0
    lease_id: str = ""
    lease_s: float = 0.0
    lease_expires_at: float | None = None  # clock seconds; None for static runners
    outstanding: int = 0                   # requests in flight through this router
    consecutive_failures: int = 0
    consecutive_successes: int = 0
    load: RunnerLoad = field(default_factory=RunnerLoad)
    last_error: str = ""
    identity: str | None = None            # the credential that registered it (None: auth off)
    verified: bool = True                  # registered runners: health and model checked

    def describe(self) -> str:
        """``id (address) STATE`` plus the last error, for messages."""
        name = self.runner_id if self.runner_id == self.address else f"{self.runner_id} ({self.address})"
        tail = f": {self.last_error}" if self.last_error and self.state is RunnerState.UNHEALTHY else ""
        return f"{name} {self.state.value}{tail}"


@dataclass(frozen=True)
class Lease:
    """What ``RegisterRunner`` grants: the lease id, its length and the heartbeat period (seconds)."""

    lease_id: str
    lease_s: float
    heartbeat_interval_s: float


#: A policy's choice function: given READY candidates (never empty), return one of them.
Chooser = Callable[[Sequence[Runner]], Runner]


class RunnerRegistry:
    """Thread-safe runner table (see the module docstring). ``clock`` returns seconds."""

    def __init__(self, config: RouterConfig, clock: Callable[[], float] = time.monotonic) -> None:
        self._config = config
        self._clock = clock
        self._lock = threading.Lock()
        self._runners: dict[str, Runner] = {}
        self._removed_listeners: list[Callable[[Runner], None]] = []
        self._ejected_listeners: list[Callable[[Runner], None]] = []
        for address in config.static_runners:
            self._runners[address] = Runner(runner_id=address, address=address, static=True,
                                            state=RunnerState.UNHEALTHY, last_error="not yet health-checked")

    def on_removed(self, listener: Callable[[Runner], None]) -> None:
        """Call ``listener(runner_copy)`` (outside the lock) whenever a runner leaves the table."""
        self._removed_listeners.append(listener)

    def on_ejected(self, listener: Callable[[Runner], None]) -> None:
        """Call ``listener(runner_copy)`` (outside the lock) whenever a READY runner becomes
        UNHEALTHY (failed health checks, or :meth:`eject`)."""
        self._ejected_listeners.append(listener)

    def _notify_ejected(self, runner: Runner | None) -> None:
        if runner is not None:
            for listener in self._ejected_listeners:
                listener(runner)

    # --- leases -------------------------------------------------------------------------------

    def check_claim(self, runner_id: str, address: str, identity: str | None) -> None:
        """Raise if ``identity`` (``None``: auth off) registering ``runner_id`` at ``address`` may
        not take it now (see the module docstring): ``PermissionDenied`` for a live id held by
        another identity, ``FailedPrecondition`` (auth off) for a live READY one at another address,
        ``InvalidArgument`` for a static id, ``ResourceExhausted`` when the table is full."""
        with self._lock:
            self._check_claim_locked(runner_id, address, identity)

    def _check_claim_locked(self, runner_id: str, address: str, identity: str | None) -> None:
        old = self._runners.get(runner_id)
        if old is not None and old.static:
            raise InvalidArgument(f"runner id {runner_id!r} is taken by a static runner")
        live = old is not None and old.lease_expires_at is not None and old.lease_expires_at > self._clock()
        if live and old.identity != identity:
            raise PermissionDenied(f"runner id {runner_id!r} is held by a live lease of another credential; "
                                   f"it cannot be taken until that lease ends")
        if live and identity is None and old.address != address and old.state is RunnerState.READY:
            raise FailedPrecondition(f"runner id {runner_id!r} is held by a READY runner at {old.address}; a "
                                f"registration from {address} may take it only once that runner is ejected, "
                                f"drained or its lease ends")
        if old is None:
            registered = sum(not r.static for r in self._runners.values())
            if registered >= self._config.max_runners:
                raise ResourceExhausted(f"the router's table is full ({self._config.max_runners} registered "
                                        f"runners, --max-runners); {runner_id!r} is refused")

    def register(self, runner_id: str, address: str, *, model: str = "", max_num_seqs: int = 0,
                 lease_s: float = 0.0, identity: str | None = None, verified: bool = True) -> Lease:
        """Add or replace a registered runner (a restarted runner keeps its id): READY when
        ``verified``, else UNHEALTHY until :meth:`mark_verified`. ``identity`` is the registering
        credential's name (``None``: auth off); :meth:`check_claim` says who may.

        ``lease_s`` 0 means the configured default; others are clamped to [min, max].
        Raises ``InvalidArgument`` for an empty id, a bad address, a negative or NaN lease, or an id
        that names a static runner, and what :meth:`check_claim` raises.
        """
        if not runner_id:
            raise InvalidArgument("runner_id is empty")
        parse_address(address, what="runner address")
        if not lease_s >= 0:  # NaN too: it would grant a lease that never expires
            raise InvalidArgument(f"lease_seconds must be a number >= 0, got {lease_s}")
        if max_num_seqs < 0:
            raise InvalidArgument(f"max_num_seqs must be >= 0, got {max_num_seqs}")
        cfg = self._config
        granted = cfg.default_lease_s if lease_s == 0 else min(max(lease_s, cfg.min_lease_s), cfg.max_lease_s)
        lease = Lease(uuid.uuid4().hex, granted, granted / 3)
        with self._lock:
            self._check_claim_locked(runner_id, address, identity)
            old = self._runners.get(runner_id)
            self._runners[runner_id] = Runner(
                runner_id=runner_id, address=address, static=False,
                state=RunnerState.READY if verified else RunnerState.UNHEALTHY,
                model=model, max_num_seqs=max_num_seqs, lease_id=lease.lease_id, lease_s=granted,
                lease_expires_at=self._clock() + granted,
                outstanding=old.outstanding if old is not None else 0,
                identity=identity, verified=verified, last_error="" if verified else "not yet verified",
            )
        return lease

    def mark_verified(self, runner_id: str, lease_id: str) -> bool:
        """The runner holding ``lease_id`` passed its admission check: READY (unless DRAINING).
        ``False`` when that lease is no longer in the table."""
        with self._lock:
            r = self._runners.get(runner_id)
            if r is None or r.lease_id != lease_id:
                return False
            r.verified = True
            if r.state is RunnerState.UNHEALTHY:
                r.state, r.last_error, r.consecutive_failures = RunnerState.READY, "", 0
            return True

    def models(self, exclude: str = "") -> set[str]:
        """The non-empty models of the verified registered and the static runners (but ``exclude``)."""
        with self._lock:
            return {r.model for r in self._runners.values()
                    if r.model and r.verified and r.runner_id != exclude}

    def heartbeat(self, runner_id: str, lease_id: str, load: RunnerLoad | None = None, *,
                  identity: str | None = None, leaving: bool = False) -> float | None:
        """Renew a lease and record the load (``leaving``: also mark it DRAINING, the runner is
        shutting down); returns the lease length (seconds), or ``None`` when the runner or lease
        is unknown or already expired (it must register again). Raises ``PermissionDenied`` when
        ``identity`` is not the one that registered it."""
        removed = None
        with self._lock:
            r = self._runners.get(runner_id)
            if r is None or r.static or r.lease_id != lease_id:
                return None
            if r.identity != identity:
                raise PermissionDenied(f"runner {runner_id!r} was registered by another credential")
            now = self._clock()
            if r.lease_expires_at is not None and r.lease_expires_at <= now:
                removed = self._runners.pop(runner_id)
            else:
                r.lease_expires_at = now + r.lease_s
                if load is not None:
                    r.load = load
                if leaving:
                    r.state = RunnerState.DRAINING
                return r.lease_s
        self._notify_removed([removed])
        return None

    def expire(self) -> list[Runner]:
        """Drop every registered runner whose lease has run out; returns copies of them."""
        with self._lock:
            now = self._clock()
            gone = [rid for rid, r in self._runners.items()
                    if r.lease_expires_at is not None and r.lease_expires_at <= now]
            removed = [self._runners.pop(rid) for rid in gone]
        self._notify_removed(removed)
        return [replace(r) for r in removed]

    def drain(self, runner_id: str) -> bool:
        """Mark a runner DRAINING (no new requests). Returns ``False`` if unknown."""
        with self._lock:
            r = self._runners.get(runner_id)
            if r is None:
                return False
            r.state = RunnerState.DRAINING
            return True

    # --- health -------------------------------------------------------------------------------

    def record_result(self, runner_id: str, ok: bool, error: str = "") -> None:
        """Count a health check or call outcome; ejects / re-admits per the config thresholds.
        A DRAINING runner stays DRAINING. Unknown ids are ignored (the runner left meanwhile)."""
        ejected = None
        with self._lock:
            r = self._runners.get(runner_id)
            if r is None:
                return
            if ok:
                r.consecutive_failures = 0
                r.consecutive_successes += 1
                if r.state is RunnerState.UNHEALTHY and r.verified \
                        and r.consecutive_successes >= self._config.readmit_after:
                    r.state, r.last_error = RunnerState.READY, ""
            else:
                r.consecutive_successes = 0
                r.consecutive_failures += 1
                r.last_error = error
                if r.state is RunnerState.READY and r.consecutive_failures >= self._config.eject_after:
                    r.state = RunnerState.UNHEALTHY
                    ejected = replace(r)
        self._notify_ejected(ejected)

    def eject(self, runner_id: str, error: str) -> None:
        """Mark a READY runner UNHEALTHY at once (its connection failed); health checks re-admit it."""
        ejected = None
        with self._lock:
            r = self._runners.get(runner_id)
            if r is None:
                return
            r.consecutive_successes = 0
            r.consecutive_failures = max(r.consecutive_failures, 1)
            r.last_error = error
            if r.state is RunnerState.READY:
                r.state = RunnerState.UNHEALTHY
                ejected = replace(r)
        self._notify_ejected(ejected)

    # --- routing ------------------------------------------------------------------------------

    def acquire(self, choose: Chooser, exclude: frozenset[str] = frozenset()) -> Runner | None:
        """Pick a READY runner not in ``exclude`` with ``choose`` and count one more request on it,
        atomically. Returns a copy of the chosen runner, or ``None`` when there is no candidate.
        Pair every successful call with :meth:`release`."""
        with self._lock:
            candidates = sorted((r for r in self._runners.values()
                                 if r.state is RunnerState.READY and r.runner_id not in exclude),
                                key=lambda r: r.runner_id)
            if not candidates:
                return None
            chosen = choose(candidates)
            chosen.outstanding += 1
            return replace(chosen)

    def release(self, runner_id: str) -> None:
        """One request on ``runner_id`` finished (however it ended)."""
        with self._lock:
            r = self._runners.get(runner_id)
            if r is not None and r.outstanding > 0:
                r.outstanding -= 1

    # --- views --------------------------------------------------------------------------------

    def is_ready(self, runner_id: str) -> bool:
        """Whether ``runner_id`` is in the table and READY now."""
        with self._lock:
            r = self._runners.get(runner_id)
            return r is not None and r.state is RunnerState.READY

    def snapshot(self) -> list[Runner]:
        """Copies of every runner, sorted by id."""
        with self._lock:
            return [replace(r) for _, r in sorted(self._runners.items())]

    def lease_remaining_s(self, runner: Runner) -> float:
        """Seconds until ``runner``'s lease runs out; -1 for static runners."""
        if runner.lease_expires_at is None:
            return -1.0
        return max(0.0, runner.lease_expires_at - self._clock())

    def describe(self) -> str:
        """One line naming every runner and its state, for error messages."""
        runners = self.snapshot()
        if not runners:
            return "no runner is registered"
        return "; ".join(r.describe() for r in runners)

    def _notify_removed(self, removed: list[Runner]) -> None:
        for r in removed:
            for listener in self._removed_listeners:
                listener(replace(r))
