"""Fixtures for the kernel-cache tests: a store, an in-process gRPC server over it, a daemon
subprocess started through the real ``warmserve cache serve`` command, and helper processes."""

from __future__ import annotations

import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
from kc_workers import REPO, child_env

from kernel_cache_service.limits import DEFAULT_PUBLISH_IDLE_S
from kernel_cache_service.servicer import build_server
from kernel_cache_service.store import KernelStore
from services.bootstrap import ServerConfig
from services.procs import wait_for_log_record

WORKERS = Path(__file__).with_name("kc_workers.py")


@pytest.fixture(params=["disk", "s3"])
def store(request, tmp_path: Path) -> KernelStore:
    """The store under test: the disk store at ``tmp_path/root``, or (``s3``) the S3-backed store
    on a fresh bucket with its local tier there; the contract tests run against both."""
    if request.param == "disk":
        return KernelStore(tmp_path / "root")
    from kernel_cache_service.s3_store import S3KernelStore

    return S3KernelStore.open_url(request.getfixturevalue("s3").url, tmp_path / "root")


@dataclass
class InProcessCache:
    server: object
    store: KernelStore
    address: str


@pytest.fixture
def grpc_cache(tmp_path: Path):
    """Factory: ``grpc_cache(auth=None, max_bytes=0, root=None, store=None, max_streams=256,
    publish_idle_s=60)`` starts a KernelCache server on a free loopback port in this process
    (``store``: an ``s3://`` URL to serve an S3-backed store with its local tier at ``root``);
    every server started is stopped at teardown."""
    started = []

    def start(*, auth=None, max_bytes: int = 0, root: Path | None = None,
              store: str | None = None, max_streams: int = ServerConfig.max_streams,
              publish_idle_s: float = DEFAULT_PUBLISH_IDLE_S) -> InProcessCache:
        root = root or tmp_path / f"grpc-root-{len(started)}"
        if store:
            from kernel_cache_service.s3_store import S3KernelStore

            store = S3KernelStore.open_url(store, root, max_bytes=max_bytes)
        else:
            store = KernelStore(root, max_bytes=max_bytes)
        cfg = ServerConfig(service="kernel-cache-test", auth=auth, max_streams=max_streams)
        server = build_server(store, cfg, publish_idle_s=publish_idle_s)
        server.start()
        started.append(server)
        return InProcessCache(server, store, server.address)

    yield start
    for server in started:
        server.stop()


@dataclass
class Daemon:
    proc: subprocess.Popen
    address: str
    root: Path
    log: Path


@pytest.fixture
def daemon(tmp_path: Path):
    """Factory: ``daemon(*extra_args)`` runs ``warmserve cache serve --root R --port 0 ...`` as a
    subprocess and waits until it logs its address; killed at teardown if still running."""
    procs: list[subprocess.Popen] = []

    def start(*extra: str) -> Daemon:
        n = len(procs)
        root, log = tmp_path / f"daemon-root-{n}", tmp_path / f"daemon-{n}.log"
        with open(log, "wb") as err:
            proc = subprocess.Popen(
                [sys.executable, "-m", "warmserve.cli", "cache", "serve", "--root", str(root), "--port", "0", *extra],
                stdout=subprocess.DEVNULL, stderr=err, env=child_env(), cwd=REPO,
            )
        procs.append(proc)
        rec = wait_for_log_record(proc, log, "kernel cache ready")
        return Daemon(proc, rec["address"], root, log)

    yield start
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
        proc.wait(timeout=30)


@pytest.fixture
def worker():
    """Factory: ``worker(cmd, target, name, fp)`` runs ``kc_workers.py`` and waits for its first
    stdout line (``ready``/``miss``); returns ``(proc, line)``. Killed at teardown."""
    procs: list[subprocess.Popen] = []

    def start(*args: str) -> tuple[subprocess.Popen, str]:
        proc = subprocess.Popen([sys.executable, str(WORKERS), *args], stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, env=child_env(), text=True)
        procs.append(proc)
        line = proc.stdout.readline().strip()
        return proc, line

    yield start
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
        proc.wait(timeout=30)
        for stream in (proc.stdin, proc.stdout):
            if stream is not None:
                stream.close()
