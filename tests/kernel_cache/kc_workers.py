"""Worker code for the kernel-cache tests that need other processes.

Imported by ``multiprocessing`` (spawn) children and run as a script by ``subprocess``:

    python kc_workers.py slow-publish ROOT NAME FINGERPRINT      (embedded store, never finishes)
    python kc_workers.py slow-publish-grpc ADDR NAME FINGERPRINT (daemon, never finishes)
    python kc_workers.py hold-read ROOT NAME FINGERPRINT         (holds a read lease until stdin closes)
    python kc_workers.py build-forever ROOT|ADDR NAME FINGERPRINT (claims OWNER with a 1 s TTL and renews
                                                                 it every 0.2 s, never publishing)

Each prints ``ready`` on stdout once it is in the state the test wants to interrupt.
"""

from __future__ import annotations

import hashlib
import os
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def child_env() -> dict:
    """Environment for child processes: the repo and this directory importable."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), str(Path(__file__).parent), env.get("PYTHONPATH", "")])
    return env


def tree_digest(path: Path) -> str:
    """sha256 over a file's bytes, or over a directory's sorted (relative path, bytes) pairs."""
    path = Path(path)
    sha = hashlib.sha256()
    if path.is_file():
        sha.update(path.read_bytes())
        return sha.hexdigest()
    for p in sorted(path.rglob("*")):
        sha.update(str(p.relative_to(path)).encode() + b"\0")
        if p.is_file():
            sha.update(p.read_bytes())
    return sha.hexdigest()


def make_artifact(path: Path, tag: str, *, as_dir: bool, size: int = 64 * 1024) -> Path:
    """A file (or a directory of two files) whose bytes are unique to ``tag``."""
    body = tag.encode() + os.urandom(size)
    if not as_dir:
        path.write_bytes(body)
        return path
    (path / "sub").mkdir(parents=True)
    (path / "kernel.so").write_bytes(body)
    (path / "sub" / "meta.json").write_text(f'{{"tag": "{tag}"}}')
    return path


def race_worker(idx: int, target: dict, rounds: int, barrier, queue, workdir: str) -> None:
    """Publish one key per round at the same moment as the other workers, then fetch it back.
    ``target``: ``{"address": ...}`` (a daemon), or ``{"root": ...}`` (an embedded store; a
    ``{worker}`` in it gives each worker its own root, i.e. its own host) with an optional
    ``"store": "s3://..."`` the embedded stores share."""
    from kernel_cache_service.client import KernelCacheClient

    work = Path(workdir)
    root = target.get("root")
    client = KernelCacheClient(target.get("address"), root=root.format(worker=idx) if root else None,
                               store=target.get("store"))
    results = []
    try:
        for r in range(rounds):
            src = make_artifact(work / f"src-w{idx}-r{r}", f"worker {idx} round {r}", as_dir=r % 2 == 1)
            barrier.wait(timeout=120)
            status = client.publish("race.program", f"fp-{r}", src, producer=f"worker-{idx}")
            barrier.wait(timeout=120)
            out = work / f"out-w{idx}-r{r}"
            info = client.fetch("race.program", f"fp-{r}", out)
            results.append((r, status, tree_digest(src), tree_digest(out) if info else None))
    except BaseException as e:  # report, do not hang the parent
        queue.put((idx, f"error: {e!r}"))
        raise
    finally:
        client.close()
    queue.put((idx, results))


def _slow_chunks():
    yield b"x" * 65536
    print("ready", flush=True)
    while True:
        time.sleep(0.05)
        yield b"y" * 4096


def main(argv: list[str]) -> int:
    cmd, target, name, fp = argv
    if cmd == "slow-publish":
        from kernel_cache_service.store import KernelStore

        store = KernelStore(target)
        with store.begin_publish(name, fp, size=1 << 30, sha256="0" * 64) as pending:
            for block in _slow_chunks():
                pending.write(block)
    elif cmd == "slow-publish-grpc":
        from services.channel import open_channel
        from services.proto import kernel_cache_pb2 as pb
        from services.proto import kernel_cache_pb2_grpc as pb_grpc

        stub = pb_grpc.KernelCacheStub(open_channel(target))
        header = pb.PublishHeader(key=pb.ProgramKey(name=name, fingerprint=fp), size_bytes=1 << 30,
                                  sha256="0" * 64, format="file")
        stub.Publish(_grpc_requests(pb, header))
    elif cmd == "hold-read":
        from kernel_cache_service.store import KernelStore

        reader = KernelStore(target).open(name, fp)
        print("ready" if reader is not None else "miss", flush=True)
        sys.stdin.read()
        if reader is not None:
            reader.close()
    elif cmd == "build-forever":
        from kernel_cache_service.client import KernelCacheClient

        is_dir = os.path.isdir(target)
        client = KernelCacheClient(None if is_dir else target, root=target if is_dir else None)
        handle = client.claim(name, fp, holder=f"builder-{os.getpid()}", ttl_s=1.0)
        print("ready" if handle.status == "OWNER" else handle.status.lower(), flush=True)
        lease = handle.claim.lease
        while lease is not None:
            time.sleep(0.2)
            lease = client.renew(lease)
    else:
        raise SystemExit(f"unknown command {cmd}")
    return 0


def _grpc_requests(pb, header):
    yield pb.PublishRequest(header=header)
    for block in _slow_chunks():
        yield pb.PublishRequest(chunk=block)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
