"""A fleet of ``warmserve runner serve`` processes on one empty kernel cache, on a tiny HF
checkpoint: single-flight builds (one compile per program for the whole fleet), eager serving
before the compiled programs arrive, and the takeover of a build whose runner was SIGKILLed.

Each test starts from an empty kernel cache and an empty Inductor cache (``TORCHINDUCTOR_CACHE_DIR``
per test), so the compile is a real cold one (tens of seconds here) and "before the compile
finishes" means something. Time bounds come from the TTLs the tests configure, with margin."""

from __future__ import annotations

import fcntl
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import grpc
import pytest
from weights_tiny import write_tiny_checkpoint

from kernel_cache_service.client import KernelCacheClient
from services.procs import stop_process, wait_for_log_record
from services.proto import generation_pb2 as pb
from services.proto import generation_pb2_grpc

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
PROMPTS = ["w5 w6 w7", "w9 w1 w2 w3", "w4"]
PROGRAMS = ("llama.decode.aoti", "llama.prefill.aoti")


class Fleet:
    """Runner processes sharing a checkpoint, a sidecar directory and a kernel cache."""

    def __init__(self, tmp_path: Path, ckpt: Path, cache_flag: list[str]) -> None:
        self.tmp, self.ckpt, self.cache_flag = tmp_path, ckpt, cache_flag
        self.procs: dict[str, subprocess.Popen] = {}
        self.logs: dict[str, Path] = {}
        self.addresses: dict[str, str] = {}
        self.env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=str(tmp_path / "inductor"),
                        WARMSERVE_HOME=str(tmp_path / "home"))

    def launch(self, name: str, *extra: str) -> None:
        cmd = [sys.executable, "-m", "warmserve.cli", "runner", "serve", "--model", str(self.ckpt),
               "--sidecar-dir", str(self.tmp / "sidecars"), "--port", "0", "--runner-id", name,
               "--max-model-len", "64", "--kv-cache-bytes", "2000000", "--max-num-seqs", "4", "--threads", "1",
               "--dtype", "f32", "--compile", "aoti", "--drain-grace", "2", *self.cache_flag, *extra]
        self.logs[name] = self.tmp / f"{name}.log"
        with open(self.logs[name], "wb") as log:
            self.procs[name] = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=log, env=self.env, cwd=REPO)

    def wait_ready(self, name: str, timeout_s: float = 300) -> str:
        rec = wait_for_log_record(self.procs[name], self.logs[name], "ready", timeout_s=timeout_s)
        self.addresses[name] = rec["address"]
        return rec["address"]

    def info(self, name: str) -> pb.ModelInfoResponse:
        with grpc.insecure_channel(self.addresses[name]) as ch:
            return generation_pb2_grpc.GenerationStub(ch).ModelInfo(pb.ModelInfoRequest(), timeout=10)

    def greedy(self, name: str) -> list[list[int]]:
        with grpc.insecure_channel(self.addresses[name]) as ch:
            stub = generation_pb2_grpc.GenerationStub(ch)
            out = []
            for prompt in PROMPTS:
                req = pb.GenerateRequest(text=prompt, sampling=pb.SamplingParams(max_tokens=12, temperature=0,
                                                                                 ignore_eos=True))
                out.append([t for m in stub.Generate(req, timeout=120) for t in m.token_ids])
            return out

    def wait_installed(self, name: str, timeout_s: float = 600) -> pb.ModelInfoResponse:
        end = time.monotonic() + timeout_s
        while True:
            info = self.info(name)
            if info.program_state != "pending":
                return info
            assert time.monotonic() < end, f"{name}: programs still pending: {info.program_detail}"
            time.sleep(0.5)

    def stop(self) -> None:
        for proc in self.procs.values():
            stop_process(proc, grace_s=20)


@pytest.fixture
def fleet(tmp_path):
    ckpt = tmp_path / "ckpt"
    write_tiny_checkpoint(ckpt, tokenizer=True, vocab=96)
    made: list[Fleet] = []

    def make(cache_flag: list[str]) -> Fleet:
        made.append(Fleet(tmp_path, ckpt, cache_flag))
        return made[-1]

    yield make
    for f in made:
        f.stop()


@pytest.fixture
def cache_daemon(tmp_path):
    root, log = tmp_path / "kc-daemon", tmp_path / "kc-daemon.log"
    with open(log, "wb") as err:
        proc = subprocess.Popen([sys.executable, "-m", "warmserve.cli", "cache", "serve", "--root", str(root),
                                 "--port", "0"], stdout=subprocess.DEVNULL, stderr=err, cwd=REPO)
    try:
        yield wait_for_log_record(proc, log, "kernel cache ready")["address"], root
    finally:
        stop_process(proc, grace_s=10)


def _store_is_clean(root: Path) -> None:
    """One entry per program, no temp directories, no lease records, no lock held."""
    entries = sorted(f"{p.parent.name}/{p.name}" for p in (root / "entries").glob("*/*"))
    assert [e.split("/")[0] for e in entries] == sorted(PROGRAMS), entries
    assert list((root / "tmp").iterdir()) == []
    assert list((root / "leases").rglob("*.json")) == []
    for lock in (root / "locks").rglob("*.lock"):
        fd = os.open(lock, os.O_RDONLY)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # raises BlockingIOError if anyone holds it
        finally:
            os.close(fd)


def _storm(fleet: Fleet, runners: int = 4) -> tuple[dict, dict, dict]:
    """Start ``runners`` runners at once, have each answer while its programs are pending, wait for
    the programs, answer again; returns ``({name: outputs before}, {name: outputs after}, {name: info})``."""
    names = [f"fleet-{i}" for i in range(runners)]
    t0 = time.monotonic()
    for n in names:
        fleet.launch(n)
    assert time.monotonic() - t0 < 1.0  # launched within the same second
    before, states = {}, {}

    def first_answer(n: str) -> None:
        fleet.wait_ready(n)
        before[n] = fleet.greedy(n)
        states[n] = fleet.info(n).program_state

    threads = [threading.Thread(target=first_answer, args=(n,)) for n in names]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=600)
    # every runner served (eager) while its compiled programs were still on their way
    assert states == {n: "pending" for n in names}, states
    infos = {n: fleet.wait_installed(n) for n in names}
    after = {n: fleet.greedy(n) for n in names}
    return before, after, infos


def _one_compile_per_program(infos: dict) -> None:
    details = {n: i.program_detail for n, i in infos.items()}
    assert all(i.program_state == "installed" for i in infos.values()), details
    for program in PROGRAMS:
        compiled = [n for n, d in details.items() if f"compiled {program}" in d]
        fetched = [n for n, d in details.items() if f"fetched {program} from " in d]
        assert len(compiled) == 1 and len(fetched) == len(infos) - 1, details
        assert all(f"from {compiled[0]}'s publish" in details[n] for n in fetched), details


def _same_greedy_text(before: dict, after: dict) -> None:
    reference = before["fleet-0"]
    assert all(len(t) == 12 for t in reference)
    assert all(out == reference for out in [*before.values(), *after.values()]), (before, after)


def test_launch_storm_on_a_kernel_cache_daemon_compiles_each_program_once(fleet, cache_daemon):
    address, root = cache_daemon
    before, after, infos = _storm(fleet(["--kernel-cache", address]))
    _one_compile_per_program(infos)
    _same_greedy_text(before, after)
    with KernelCacheClient(address) as kc:
        stat = kc.stat()
    assert (stat["builds"], stat["publishes"], stat["takeovers"], stat["leases"]) == (2, 2, 0, 0), stat
    assert stat["waits"] >= 1, stat
    _store_is_clean(root)


def test_launch_storm_on_a_shared_directory_compiles_each_program_once(fleet, tmp_path):
    # two runners: the directory's file-lock leases between processes (the daemon storm above has
    # four; the leases' own semantics over a directory are tests/kernel_cache/test_kc_leases.py's)
    root = tmp_path / "kc-dir"
    before, after, infos = _storm(fleet(["--kernel-cache-dir", str(root)]), runners=2)
    _one_compile_per_program(infos)
    _same_greedy_text(before, after)
    _store_is_clean(root)


def test_a_sigkilled_builder_is_taken_over_within_the_lease_ttl(fleet, cache_daemon):
    address, root = cache_daemon
    f = fleet(["--kernel-cache", address, "--build-lease-ttl", "2"])
    f.launch("builder")
    f.wait_ready("builder")
    kc = KernelCacheClient(address)
    end = time.monotonic() + 120
    while kc.stat()["leases"] == 0:  # the builder holds the lease of the program it compiles
        assert time.monotonic() < end, "the builder never claimed a build"
        time.sleep(0.1)
    f.launch("waiter")
    f.wait_ready("waiter")
    end = time.monotonic() + 120
    while "waiting for builder" not in f.info("waiter").program_detail:
        assert time.monotonic() < end, f.info("waiter").program_detail
        time.sleep(0.1)
    assert f.info("builder").program_state == "pending"  # mid-compile
    f.procs["builder"].send_signal(signal.SIGKILL)
    f.procs["builder"].wait(timeout=10)
    killed = time.monotonic()
    while kc.stat()["takeovers"] == 0:
        assert time.monotonic() - killed < 10, kc.stat()  # 2 s TTL + claim, with margin
        time.sleep(0.1)
    info = f.wait_installed("waiter")
    assert info.program_state == "installed" and "took over an expired build lease" in info.program_detail, info
    stat = kc.stat()
    kc.close()
    assert (stat["takeovers"], stat["publishes"], stat["leases"]) == (1, 2, 0), stat
    assert len(f.greedy("waiter")[0]) == 12
    f.stop()
    _store_is_clean(root)
