"""Single-flight builds: Claim (HIT / OWNER / WAIT), lease renewal, release, expiry and takeover,
through the embedded store and through a gRPC server over it, within one process and across
processes (a builder SIGKILLed mid-build loses its lease after its TTL)."""

from __future__ import annotations

import os
import signal
import threading
import time
from dataclasses import replace
from pathlib import Path

import grpc
import pytest
from auth_tokens import make_creds

from kernel_cache_service.client import KernelCacheClient
from kernel_cache_service.leases import LeaseFile
from kernel_cache_service.servicer import StoreCollector
from kernel_cache_service.store import KernelStore
from services.errors import InvalidArgument, Unauthenticated, Unavailable

FP = "ab" * 32


@pytest.fixture(params=["embedded", "grpc"])
def clients(request, tmp_path, grpc_cache):
    """Factory of clients that share one store (each embedded client opens its own store object on
    the root, as separate processes would); the store itself for counters and files."""
    root = tmp_path / "root"
    made: list[KernelCacheClient] = []
    if request.param == "embedded":
        store = KernelStore(root)

        def make() -> KernelCacheClient:
            made.append(KernelCacheClient(root=root))
            return made[-1]
    else:
        cache = grpc_cache(root=root)
        store = cache.store

        def make() -> KernelCacheClient:
            made.append(KernelCacheClient(cache.address))
            return made[-1]

    yield make, store, request.param
    for c in made:
        c.close()


def _artifact(tmp_path: Path, text: str = "program bytes") -> Path:
    path = tmp_path / "artifact.bin"
    path.write_text(text)
    return path


def _counters(store: KernelStore, client: KernelCacheClient, mode: str) -> dict:
    """The daemon's counters (gRPC) or the claimants' (embedded: each client has its own store)."""
    return store.stat() if mode == "grpc" else client.stat()


def _lease_files(root: Path) -> list[Path]:
    return sorted((root / "leases").rglob("*.json"))


def test_first_claim_builds_second_waits_until_the_publish(tmp_path, clients):
    make, store, mode = clients
    builder, waiter = make(), make()
    owner = builder.claim("p.decode", FP, holder="runner-0", ttl_s=30)
    assert owner.status == "OWNER" and owner.claim.takeover is False
    assert owner.claim.lease.holder == "runner-0" and 29 < owner.claim.lease.remaining_s() <= 30
    wait = waiter.claim("p.decode", FP, holder="runner-1")
    assert wait.status == "WAIT"
    assert wait.claim.lease.holder == "runner-0"  # who builds, for the report
    got = {}
    t = threading.Thread(target=lambda: got.setdefault("event", wait.wait()))
    t.start()
    time.sleep(0.3)
    assert t.is_alive()  # nothing published yet: still waiting
    assert builder.publish("p.decode", FP, _artifact(tmp_path), producer="runner-0") == "PUBLISHED"
    t.join(timeout=10)
    assert not t.is_alive()
    event = got["event"]
    assert event.status == "PUBLISHED" and event.entry.producer == "runner-0"
    assert waiter.claim("p.decode", FP).status == "HIT"
    assert builder.renew(owner.claim.lease) is None  # the publish ended the lease
    assert _lease_files(store.root) == [] and store.leases() == []
    if mode == "grpc":
        s = store.stat()
        assert (s["claims"], s["waits"], s["builds"], s["takeovers"], s["publishes"], s["leases"]) == (3, 1, 1, 0, 1, 0)


def test_concurrent_claims_grant_exactly_one_owner(clients):
    make, _store, _mode = clients
    claimants = [make() for _ in range(8)]
    barrier = threading.Barrier(len(claimants))
    statuses: list[str] = []

    def claim(c: KernelCacheClient) -> None:
        barrier.wait(timeout=10)
        h = c.claim("p.decode", FP, holder=f"c{id(c)}")
        statuses.append(h.status)
        h.cancel()

    threads = [threading.Thread(target=claim, args=(c,)) for c in claimants]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert sorted(statuses) == ["OWNER"] + ["WAIT"] * 7


def test_release_ends_the_wait_and_the_next_claim_builds(clients):
    make, store, mode = clients
    builder, waiter = make(), make()
    owner = builder.claim("p.decode", FP, holder="b")
    wait = waiter.claim("p.decode", FP, holder="w")
    t0 = time.monotonic()
    threading.Timer(0.3, lambda: builder.release(owner.claim.lease)).start()
    event = wait.wait()
    assert event.status == "LEASE_EXPIRED"
    assert time.monotonic() - t0 < 5  # told at the release, long before the 30 s TTL
    assert builder.release(owner.claim.lease) is False  # already released
    again = waiter.claim("p.decode", FP, holder="w")
    assert again.status == "OWNER" and again.claim.takeover is False  # a release is no takeover
    assert _counters(store, waiter, mode)["takeovers"] == 0


def test_an_unrenewed_lease_expires_and_one_waiter_takes_over(clients):
    make, store, mode = clients
    builder, waiter = make(), make()
    owner = builder.claim("p.decode", FP, holder="b", ttl_s=0.5)
    assert waiter.claim("p.decode", FP).status == "WAIT"
    event = waiter.claim("p.decode", FP).wait()
    assert event.status == "LEASE_EXPIRED" and owner.claim.lease.remaining_s() <= 0
    takeover = waiter.claim("p.decode", FP, holder="w")
    assert takeover.status == "OWNER" and takeover.claim.takeover is True
    assert builder.renew(owner.claim.lease) is None  # the old builder lost it
    assert make().claim("p.decode", FP).status == "WAIT"  # the new lease is live
    c = _counters(store, waiter, mode)
    assert (c["builds"], c["takeovers"]) == ((2, 1) if mode == "grpc" else (1, 1))


def test_renewing_keeps_the_lease_past_its_ttl(clients):
    make, _store, _mode = clients
    builder, other = make(), make()
    lease = builder.claim("p.decode", FP, holder="b", ttl_s=1.2).claim.lease  # 1 s of slack on a busy host
    end = time.monotonic() + 3.6  # three TTLs
    while time.monotonic() < end:
        renewed = builder.renew(lease)
        assert renewed is not None and renewed.lease_id == lease.lease_id and renewed.expires > lease.expires - 1e-6
        lease = renewed
        time.sleep(0.15)
    h = other.claim("p.decode", FP)
    assert h.status == "WAIT" and h.claim.lease.lease_id == lease.lease_id
    h.cancel()


def test_a_torn_lease_record_reads_as_expired(store):
    owner = store.claim("p.decode", FP, "b")
    path = store.root / "leases" / "p.decode" / f"{FP}.json"
    path.write_bytes(path.read_bytes()[:17])  # a writer killed mid-write
    assert LeaseFile(path).read().remaining_s() < 0
    taken = store.claim("p.decode", FP, "w")
    assert taken.status == "OWNER" and taken.takeover is True
    assert store.renew(owner.lease) is None


def test_bad_claims_are_refused(clients, tmp_path):
    make, _store, mode = clients
    c = make()
    for kwargs, needle in (({"fingerprint": "UNKNOWN"}, "UNKNOWN"), ({"ttl_s": -1}, "TTL"),
                           ({"ttl_s": 4000}, "TTL"), ({"ttl_s": 1e-300}, "TTL"), ({"ttl_s": float("nan")}, "TTL"),
                           ({"name": "../x"}, "name")):
        args = {"name": "p.decode", "fingerprint": FP, **kwargs}
        with pytest.raises(InvalidArgument, match=needle):
            c.claim(args["name"], args["fingerprint"], ttl_s=args.get("ttl_s"))
    assert _lease_files(tmp_path / "root") == []


def test_claim_rpcs_need_the_token(grpc_cache, tmp_path):
    creds = make_creds(tmp_path / "auth", builder="read,publish")
    cache = grpc_cache(auth=creds.table)
    with KernelCacheClient(cache.address) as anon:
        with pytest.raises(Unauthenticated):
            anon.claim("p.decode", FP)
    with KernelCacheClient(cache.address, security=creds.security("builder")) as ok:
        h = ok.claim("p.decode", FP)
        assert h.status == "OWNER" and ok.release(h.claim.lease) is True


def test_a_raw_grpc_waiter_can_cancel_its_wait(grpc_cache):
    """A client that stops waiting (cancels the stream) frees the server's handler."""
    from services.channel import open_channel
    from services.proto import kernel_cache_pb2 as pb
    from services.proto import kernel_cache_pb2_grpc as pb_grpc

    cache = grpc_cache()
    stub = pb_grpc.KernelCacheStub(open_channel(cache.address))
    key = pb.ProgramKey(name="p.decode", fingerprint=FP)
    first = next(stub.Claim(pb.ClaimRequest(key=key, holder="a")))
    assert first.status == pb.ClaimResponse.STATUS_OWNER
    stream = stub.Claim(pb.ClaimRequest(key=key, holder="b"))
    assert next(stream).status == pb.ClaimResponse.STATUS_WAIT
    stream.cancel()
    with pytest.raises(grpc.RpcError) as e:
        next(stream)
    assert e.value.code() == grpc.StatusCode.CANCELLED
    bad = stub.Claim(pb.ClaimRequest(key=key, ttl_s=-3))
    with pytest.raises(grpc.RpcError) as e:
        next(bad)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "TTL" in e.value.details()


def test_lease_counters_are_prometheus_metrics(store):
    store.claim("p.decode", FP, "a")
    store.claim("p.decode", FP, "b")
    metrics = {m.name: m.samples[0].value for m in StoreCollector(store).collect()}
    assert metrics["warmserve_kernel_cache_claims"] == 2
    assert metrics["warmserve_kernel_cache_waits"] == 1
    assert metrics["warmserve_kernel_cache_builds"] == 1
    assert metrics["warmserve_kernel_cache_takeovers"] == 0
    assert metrics["warmserve_kernel_cache_leases"] == 1


@pytest.mark.parametrize("via", ["embedded", "daemon"])
def test_a_sigkilled_builder_loses_its_lease_after_its_ttl(tmp_path, worker, daemon, via):
    """Another process claims (1 s TTL, renewing), is SIGKILLed; a waiter here gets LEASE_EXPIRED
    within a few TTLs and takes the build over; no lease is left once it publishes."""
    if via == "daemon":
        d = daemon()
        target, root = d.address, d.root
    else:
        root = tmp_path / "shared"
        KernelStore(root)
        target = str(root)
    proc, line = worker("build-forever", target, "p.decode", FP)
    assert line == "ready"
    client = KernelCacheClient(target) if via == "daemon" else KernelCacheClient(root=root)
    with client:
        h = client.claim("p.decode", FP, holder="waiter")
        assert h.status == "WAIT" and h.claim.lease.holder == f"builder-{proc.pid}"
        time.sleep(1.5)  # past the TTL: the builder's renewals keep it alive
        assert client.claim("p.decode", FP).status == "WAIT"
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)
        t0 = time.monotonic()
        assert h.wait().status == "LEASE_EXPIRED"
        assert time.monotonic() - t0 < 10  # the 1 s TTL, with a wide margin
        taken = client.claim("p.decode", FP, holder="waiter")
        assert taken.status == "OWNER" and taken.claim.takeover is True
        assert client.publish("p.decode", FP, _artifact(tmp_path)) == "PUBLISHED"
        assert client.stat()["leases"] == 0
    assert _lease_files(root) == [] and list((root / "tmp").iterdir()) == []


def test_a_renewal_uses_the_granted_lease_not_what_the_caller_sends(clients):
    make, _store, _mode = clients
    c = make()
    lease = c.claim("p.decode", FP, holder="honest", ttl_s=2).claim.lease
    forged = replace(lease, holder="mallory", ttl_s=1e9, expires=0.0)
    renewed = c.renew(forged)
    assert (renewed.holder, renewed.ttl_s) == ("honest", 2.0) and 1.5 < renewed.remaining_s() <= 2.0
    nan = c.renew(replace(lease, ttl_s=float("nan")))
    assert nan.ttl_s == 2.0 and 1.5 < nan.remaining_s() <= 2.0
    assert make().claim("p.decode", FP).claim.lease.holder == "honest"


def test_a_store_that_starts_removes_expired_lease_records(tmp_path):
    root = tmp_path / "root"
    store = KernelStore(root)
    store.claim("p.decode", FP, "dead builder", ttl_s=0.1)
    store.claim("p.prefill", FP, "live builder", ttl_s=60)
    time.sleep(0.2)
    again = KernelStore(root)
    assert again.swept == 1
    assert [p.parent.name for p in _lease_files(root)] == ["p.prefill"]
    assert [lease.holder for lease in again.leases()] == ["live builder"]


def test_a_draining_daemon_ends_waiting_claims_at_once(grpc_cache):
    cache = grpc_cache()
    with KernelCacheClient(cache.address) as builder, KernelCacheClient(cache.address) as waiter:
        assert builder.claim("p.decode", FP).status == "OWNER"
        h = waiter.claim("p.decode", FP)
        assert h.status == "WAIT"
        drained = threading.Thread(target=cache.server.drain, args=(30.0,))
        t0 = time.monotonic()
        drained.start()
        with pytest.raises(Unavailable, match="shutting down"):
            h.wait()
        drained.join(timeout=10)
        assert not drained.is_alive() and time.monotonic() - t0 < 5  # not the 30 s grace


def test_evict_breaks_a_stuck_build_lease(clients):
    make, store, _mode = clients
    builder, other = make(), make()
    lease = builder.claim("p.decode", FP, holder="stuck", ttl_s=3600).claim.lease
    builder.claim("p.prefill", FP, holder="stuck", ttl_s=3600)
    assert other.claim("p.decode", FP).status == "WAIT"
    assert other.evict("p.decode", FP) == (0, 0)  # no entry yet; the lease goes
    assert builder.renew(lease) is None  # the stuck builder finds it gone
    assert other.claim("p.decode", FP).status == "OWNER"
    assert other.claim("p.prefill", FP).status == "WAIT"  # another key: untouched
    other.evict(all=True)
    assert _lease_files(store.root) == []
