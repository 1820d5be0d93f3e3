"""Many processes on one host: simultaneous publishes of one key, and writers killed mid-publish;
and 16 processes as 16 hosts (each its own local tier) racing on one key through one S3 bucket."""

from __future__ import annotations

import hashlib
import multiprocessing
import queue as queue_module
import signal
from collections import Counter
from pathlib import Path

import pytest
from kc_workers import race_worker

from kernel_cache_service.store import KernelStore

WORKERS = 16
ROUNDS = 5


def _run_race(target: dict, workdir: Path, rounds: int = ROUNDS) -> dict[int, list]:
    ctx = multiprocessing.get_context("spawn")
    barrier = ctx.Barrier(WORKERS)
    results = ctx.Queue()
    procs = [ctx.Process(target=race_worker, args=(i, target, rounds, barrier, results, str(workdir)))
             for i in range(WORKERS)]
    for p in procs:
        p.start()
    try:
        out = {}
        for _ in range(WORKERS):
            idx, res = results.get(timeout=300)
            assert not isinstance(res, str), f"worker {idx}: {res}"
            out[idx] = res
        for p in procs:
            p.join(timeout=60)
            assert p.exitcode == 0
        return out
    except queue_module.Empty:
        pytest.fail("race workers did not report in time")
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()


@pytest.mark.parametrize("mode", ["embedded", "daemon"])
def test_sixteen_processes_publish_the_same_key(tmp_path, grpc_cache, mode):
    workdir = tmp_path / "work"
    workdir.mkdir()
    if mode == "embedded":
        root = tmp_path / "shared-root"
        target = {"root": str(root)}
    else:
        cache = grpc_cache()
        root = cache.store.root
        target = {"address": cache.address}
    results = _run_race(target, workdir)
    for r in range(ROUNDS):
        rows = [results[i][r] for i in range(WORKERS)]
        statuses = Counter(status for _, status, _, _ in rows)
        assert statuses == {"PUBLISHED": 1, "ALREADY_PRESENT": WORKERS - 1}, (r, statuses)
        winner_src = next(src for _, status, src, _ in rows if status == "PUBLISHED")
        fetched = {got for _, _, _, got in rows}
        assert fetched == {winner_src}, f"round {r}: readers saw {len(fetched)} different artifacts"
    store = KernelStore(root)
    assert store.swept == 0  # nothing left behind for a newcomer to clean up
    assert [e.fingerprint for e in store.list()] == [f"fp-{r}" for r in range(ROUNDS)]
    assert list((root / "tmp").iterdir()) == [] and list((root / "trash").iterdir()) == []
    assert [p.name for p in workdir.iterdir() if "warmserve" in p.name] == []


def test_a_writer_killed_mid_publish_leaves_no_entry(tmp_path, worker):
    root = tmp_path / "root"
    proc, line = worker("slow-publish", str(root), "llama.decode", "f1")
    assert line == "ready"
    assert len(list((root / "tmp").iterdir())) == 1
    assert KernelStore(root).swept == 0  # a live writer's temp data is not touched
    proc.send_signal(signal.SIGKILL)
    assert proc.wait(timeout=30) == -signal.SIGKILL
    assert len(list((root / "tmp").iterdir())) == 1  # garbage, but invisible:
    store = KernelStore(root)  # ... and removed by the next store to start
    assert store.swept == 1
    assert list((root / "tmp").iterdir()) == []
    assert store.lookup("llama.decode", "f1") is None
    assert store.list() == []
    assert store.fetch("llama.decode", "f1", tmp_path / "out") is None


S3_ROUNDS = 3


def test_sixteen_hosts_publish_the_same_key_through_one_bucket(tmp_path, s3):
    """16 processes, each an embedded S3-backed store with its own local tier (a host sharing no
    disk with the others), publish different bytes under one key at the same moment: the
    conditional PUT lets exactly one win, the others are told ALREADY_PRESENT and every one of
    them fetches the winner's bytes; the bucket holds one whole object per key and nothing else."""
    workdir = tmp_path / "work"
    workdir.mkdir()
    results = _run_race({"root": str(tmp_path / "host-{worker}"), "store": s3.url}, workdir, S3_ROUNDS)
    for r in range(S3_ROUNDS):
        rows = [results[i][r] for i in range(WORKERS)]
        statuses = Counter(status for _, status, _, _ in rows)
        assert statuses == {"PUBLISHED": 1, "ALREADY_PRESENT": WORKERS - 1}, (r, statuses)
        winner_src = next(src for _, status, src, _ in rows if status == "PUBLISHED")
        assert {got for _, _, _, got in rows} == {winner_src}, f"round {r}: hosts fetched different bytes"
    # The bucket: one object per key, each the winner's bytes, no probe or partial object, no
    # multipart upload left open.
    assert s3.keys() == [f"team/kernel-cache/entries/race.program/fp-{r}" for r in range(S3_ROUNDS)]
    assert s3.client.list_multipart_uploads(Bucket=s3.bucket).get("Uploads", []) == []
    for r in range(S3_ROUNDS):
        obj = s3.client.get_object(Bucket=s3.bucket, Key=f"team/kernel-cache/entries/race.program/fp-{r}")
        body = obj["Body"].read()
        assert hashlib.sha256(body).hexdigest() == obj["Metadata"]["sha256"]
        assert len(body) == int(obj["Metadata"]["size-bytes"])
    # Each host's local tier holds exactly the winners, and no temp data.
    for i in range(WORKERS):
        host = tmp_path / f"host-{i}"
        assert list((host / "tmp").iterdir()) == [] and list((host / "quarantine").iterdir()) == []
        assert [e.fingerprint for e in KernelStore(host).list()] == [f"fp-{r}" for r in range(S3_ROUNDS)]
