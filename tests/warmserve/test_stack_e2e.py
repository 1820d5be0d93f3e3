"""End to end on the real SmolLM2: the stack as separate processes (LocalStack), one stack shared
by the module (each runner launch costs seconds). Order matters: the failover test kills
runner-1 and heals it, then the router is killed and healed."""

from __future__ import annotations

import io
import json
import queue
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import pytest

from router_service.client import list_runners
from services.errors import Unavailable
from services.generation_client import GenerationClient, chat_request, sampling_params
from services.healthcheck import check_health
from services.proto import generation_pb2, router_pb2
from warmserve.stack import LocalStack
from warmserve.stack_auth import stack_security
from warmserve.stack_config import StackConfig
from warmserve.stack_report import print_status
from warmserve.stack_state import read_state

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]

QUESTIONS = [
    "What is the capital of France?", "Name three primary colors.", "What is 7 times 8?",
    "Who wrote Romeo and Juliet?", "What is the boiling point of water?", "Translate 'thank you' to French.",
    "What is the largest planet?", "Give a synonym for happy.", "What do plants need to grow?",
    "How many days are in a week?", "What is the opposite of cold?", "Name a famous painter.",
    "What language is spoken in Brazil?", "What is H2O?", "How many legs does a spider have?",
    "What color is the sky on a clear day?",
]


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    # batch-invariant (float weights): "routed equals direct" compares requests batched 8 + 8 on two
    # runners against 16 on one; without it their rounding differs with the batch (and with when the
    # requests arrive), so the comparison held or not by the timing
    cfg = StackConfig(runners=2, base_port=0, home=tmp_path_factory.mktemp("stack"), compile="off",
                      max_num_seqs=16, lease_seconds=2.0, health_interval_s=0.25, stop_grace_s=15,
                      startup_timeout_s=240, weights_dtype="bf16", batch_invariant=True)
    s = LocalStack(cfg, progress=None)
    s.start()
    try:
        yield s
    finally:
        s.stop()


def _runner_states(stack: LocalStack) -> dict[str, int]:
    return {r.runner_id: r.state for r in list_runners(stack.router_address, security=stack.credentials("admin"))}


def test_stack_is_up_with_both_runners_registered(stack: LocalStack) -> None:
    runners = {r.runner_id: r for r in list_runners(stack.router_address, security=stack.credentials("admin"))}
    assert set(runners) == {"runner-0", "runner-1"}
    for i, name in enumerate(("runner-0", "runner-1")):
        r = runners[name]
        assert r.state == router_pb2.RunnerStatus.STATE_READY and not r.static
        assert r.address == stack.runners[i].address
        assert 0 < r.lease_expires_in_s <= 2.0
    for name in ("kernel-cache", "weights", "router"):
        assert check_health(stack.address(name)) == "SERVING"
    report = stack.startup_report(1).startup
    assert report.total_seconds > 0 and len(report.phases) >= 2


def test_16_concurrent_chats_through_the_router_equal_direct(stack: LocalStack) -> None:
    params = sampling_params(max_tokens=24, temperature=0.0)
    requests = [chat_request([("user", q)], params) for q in QUESTIONS]

    def run_all(address: str):
        with GenerationClient(address, security=stack.credentials()) as client, ThreadPoolExecutor(len(requests)) as pool:
            return list(pool.map(lambda r: client.complete(r, timeout_s=300), requests))

    routed = run_all(stack.router_address)
    direct = run_all(stack.runners[0].address)
    for q, r, d in zip(QUESTIONS, routed, direct, strict=True):
        assert r.finish_reason in ("STOP", "LENGTH") and r.text.strip(), q
        assert (r.text, r.token_ids) == (d.text, d.token_ids), q
    assert {r.runner_id for r in routed} == {"runner-0", "runner-1"}  # both runners served
    assert all(r.outstanding == 0 for r in list_runners(stack.router_address, security=stack.credentials("admin")))


def test_prefix_affinity_keeps_a_conversation_on_one_runner(stack: LocalStack) -> None:
    system = ("system", "You are a concise assistant who answers in one short sentence.")
    params = sampling_params(max_tokens=4)
    with GenerationClient(stack.router_address, security=stack.credentials()) as client:
        served = {client.complete(chat_request([system, ("user", q)], params,
                                               routing=generation_pb2.ROUTING_POLICY_PREFIX_AFFINITY)).runner_id
                  for q in QUESTIONS[:6]}
    assert len(served) == 1


def test_failover_when_a_runner_is_killed_mid_stream(stack: LocalStack) -> None:
    deadline_s = 60.0
    params = sampling_params(max_tokens=48, temperature=0.0)
    results: list[tuple[str, str, float]] = [("", "", 0.0)] * 16
    first_tokens = threading.Semaphore(0)

    def one(i: int) -> None:
        start = time.monotonic()
        req = chat_request([("user", QUESTIONS[i])], params, routing=generation_pb2.ROUTING_POLICY_ROUND_ROBIN)
        try:
            got_first = False
            with GenerationClient(stack.router_address, security=stack.credentials()) as client:
                runner = ""
                for resp in client._stub.Generate(req, timeout=deadline_s):
                    runner = resp.runner_id or runner
                    if resp.token_ids and not got_first:
                        got_first = True
                        first_tokens.release()
            results[i] = ("ok", runner, time.monotonic() - start)
        except grpc.RpcError as e:
            results[i] = (e.code().name, e.details(), time.monotonic() - start)
            if not got_first:
                first_tokens.release()

    threads = [threading.Thread(target=one, args=(i,)) for i in range(16)]
    for t in threads:
        t.start()
    for _ in range(4):  # some streams are producing tokens: the kill lands mid-stream
        assert first_tokens.acquire(timeout=120)
    killed_at = time.monotonic()
    stack.kill_runner(1, signal.SIGKILL)
    for t in threads:
        t.join(timeout=deadline_s + 10)
    assert not any(t.is_alive() for t in threads), "a request hung past its deadline"

    outcomes = [r[0] for r in results]
    assert set(outcomes) <= {"ok", "UNAVAILABLE"}, results
    assert "ok" in outcomes
    for status, detail, seconds in results:
        assert seconds < deadline_s + 1.0
        if status == "UNAVAILABLE":
            assert "runner-1" in detail, detail
    # Requests that completed came from runner-0, or from runner-1 before it died.
    assert {r[1] for r in results if r[0] == "ok"} <= {"runner-0", "runner-1"}

    # New requests go to runner-0 at once.
    with GenerationClient(stack.router_address, security=stack.credentials()) as client:
        assert client.complete(chat_request([("user", "Hi!")], sampling_params(max_tokens=4))).runner_id == "runner-0"

    # The dead runner's lease (2 s) expires and it leaves the table.
    end = time.monotonic() + 15
    while "runner-1" in _runner_states(stack):
        assert time.monotonic() < end, _runner_states(stack)
        time.sleep(0.2)
    assert time.monotonic() - killed_at >= 0.5

    # heal() relaunches it after its backoff (1 s; same port and id); it registers again and serves.
    end = time.monotonic() + 10
    while stack.runners[1].restarts == 0:
        assert stack.heal() == [] and time.monotonic() < end
        time.sleep(0.1)
    stack.wait_runners([1])
    assert stack.restarts() == {"kernel-cache": 0, "weights": 0, "router": 0, "runner-zygote": 0, "runner-0": 0,
                                "runner-1": 1}
    # `warmserve status` shows the restarts (from the stack's state file) and each runner's programs
    buf = io.StringIO()
    assert print_status(stack.router_address, {}, out=buf, restarts=read_state(stack.home, stack.router_address),
                        security=stack.credentials()) == 0
    rows = {line.split()[0]: line.split() for line in buf.getvalue().splitlines() if line.strip()}
    assert rows["runner-1"][-1] == "1" and rows["runner-0"][-1] == "0" and rows["router"][-1] == "0", buf.getvalue()
    assert rows["runner-0"][3] == rows["runner-1"][3] == "off", buf.getvalue()  # --compile off
    assert _runner_states(stack) == {"runner-0": router_pb2.RunnerStatus.STATE_READY,
                                     "runner-1": router_pb2.RunnerStatus.STATE_READY}
    with GenerationClient(stack.router_address, security=stack.credentials()) as client:
        served = {client.complete(chat_request([("user", q)], sampling_params(max_tokens=4),
                                               routing=generation_pb2.ROUTING_POLICY_ROUND_ROBIN)).runner_id
                  for q in QUESTIONS[:4]}
    assert served == {"runner-0", "runner-1"}


def test_a_killed_router_is_relaunched_and_the_runners_register_again(stack: LocalStack) -> None:
    router = stack.services["router"]
    router.proc.send_signal(signal.SIGKILL)
    router.proc.wait(timeout=10)
    with pytest.raises(Unavailable, match="cannot reach"):  # down: clients are refused, nothing hangs
        GenerationClient(stack.router_address, ready_timeout_s=1.0, security=stack.credentials())
    end = time.monotonic() + 20
    while router.restarts == 0 or check_health(stack.router_address, timeout_s=0.5) != "SERVING":
        assert stack.heal() == [] and time.monotonic() < end
        time.sleep(0.1)
    stack.wait_registered(["runner-0", "runner-1"], timeout_s=20)  # the runners' heartbeats re-register
    with GenerationClient(stack.router_address, security=stack.credentials()) as client:
        reply = client.complete(chat_request([("user", "Hi!")], sampling_params(max_tokens=4)))
    assert reply.runner_id in {"runner-0", "runner-1"} and len(reply.token_ids) == reply.completion_tokens == 4


def test_warmserve_up_starts_and_stops_cleanly_on_sigterm(tmp_path: Path) -> None:
    proc = subprocess.Popen(
        [sys.executable, "-m", "warmserve.cli", "up", "--runners", "1", "--base-port", "0",
         "--home", str(tmp_path), "--compile", "off"],
        cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    lines: queue.Queue[str | None] = queue.Queue()

    def pump() -> None:
        for line in proc.stdout:
            lines.put(line)
        lines.put(None)

    threading.Thread(target=pump, daemon=True).start()
    try:
        out: list[str] = []
        end = time.monotonic() + 300
        while not out or not out[-1].startswith("ready:"):
            line = lines.get(timeout=max(0.1, end - time.monotonic()))
            assert line is not None, f"warmserve up exited ({proc.wait()}); logs in {tmp_path / 'logs'}"
            out.append(line)
        text = "".join(out)
        assert "start-up report of runner-0" in text, text
        endpoints = dict(line.split() for line in out[out.index("endpoints:\n") + 1:] if line.startswith("  ")
                         and len(line.split()) == 2)
        openai_url = endpoints.pop("openai")  # `up` starts the OpenAI door too
        assert set(endpoints) == {"kernel-cache", "weights", "router", "runner-0"}
        assert check_health(endpoints["router"]) == "SERVING"
        key = (tmp_path / "auth" / "openai.key").read_text().strip()  # `up` made it and requires it
        with urllib.request.urlopen(urllib.request.Request(f"{openai_url}/models", headers={
                "Authorization": f"Bearer {key}"}), timeout=10) as resp:
            assert [m["id"] for m in json.load(resp)["data"]] == ["smollm2-135m-instruct"]
        with GenerationClient(endpoints["router"], security=stack_security(tmp_path)) as client:
            result = client.complete(chat_request([("user", "Hi")], sampling_params(max_tokens=3)))
        assert (result.completion_tokens, result.runner_id) == (3, "runner-0")
        status = subprocess.run([sys.executable, "-m", "warmserve.cli", "status", "--addr", endpoints["router"],
                                 "--home", str(tmp_path)], cwd=REPO, capture_output=True, text=True, timeout=60)
        assert status.returncode == 0, status.stderr
        table = [line.split() for line in status.stdout.splitlines() if line.strip()]
        assert ["service", "address", "health", "restarts"] in table, status.stdout
        assert ["kernel-cache", endpoints["kernel-cache"], "SERVING", "0"] in table, status.stdout  # from stack.json
        assert ["weights", endpoints["weights"], "SERVING", "0"] in table, status.stdout
        runner_row = next(r for r in table if r[0] == "runner-0")
        assert runner_row[2:4] == ["READY", "off"] and runner_row[-1] == "0", status.stdout
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
        for addr in endpoints.values():
            assert check_health(addr, timeout_s=0.5).startswith("UNREACHABLE"), addr
        with pytest.raises(OSError):  # the door is gone too (URLError is an OSError)
            urllib.request.urlopen(f"{openai_url}/models", timeout=2)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_status_right_after_the_work_shows_it_done(stack: LocalStack) -> None:
    """Issue 11 item 12: a status taken as soon as a burst has finished shows no request running
    or waiting and no KV block in use (the router's heartbeat load, taken during the burst, would
    still show them), and while requests run it shows them."""
    from concurrent.futures import ThreadPoolExecutor

    def load_columns() -> dict[str, tuple[str, str]]:
        buf = io.StringIO()
        assert print_status(stack.router_address, {}, out=buf, security=stack.credentials()) == 0
        rows = [line.split() for line in buf.getvalue().splitlines() if line.startswith("runner-")]
        return {r[0]: (r[7], r[8]) for r in rows}  # running/waiting, KV blocks (the lease is "1.6 s")

    with GenerationClient(stack.router_address, security=stack.credentials()) as client, ThreadPoolExecutor(8) as pool:
        sampling = generation_pb2.SamplingParams(max_tokens=160, ignore_eos=True)
        futures = [pool.submit(client.complete, generation_pb2.GenerateRequest(text=q, sampling=sampling))
                   for q in QUESTIONS[:8]]
        time.sleep(1.0)  # heartbeats (every ~0.7 s) report the burst meanwhile
        during = load_columns()
        results = [f.result(timeout=120) for f in futures]
    after = load_columns()
    assert all(r.finish_reason for r in results)
    assert any(rw != "0/0" for rw, _ in during.values()), during
    assert set(after) == {"runner-0", "runner-1"}
    for running_waiting, kv in after.values():
        assert running_waiting == "0/0" and kv.startswith("0/"), after
