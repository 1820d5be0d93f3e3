"""A frozen runner (SIGSTOP: alive, port open, answering nothing) on the real SmolLM2: with a 2 s
first-token timeout on the router, requests sent to it are cancelled and retried on the other
runner, so no request waits for the runner's lease to lapse or for its own deadline."""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest

from services.errors import WarmserveError
from services.generation_client import GenerationClient, chat_request, sampling_params
from services.proto import generation_pb2
from warmserve.stack import LocalStack
from warmserve.stack_config import StackConfig

pytestmark = pytest.mark.slow

FIRST_TOKEN_TIMEOUT_S = 2.0
FROZEN_S = 20.0
BOUND_S = 10.0


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    cfg = StackConfig(runners=2, base_port=0, home=tmp_path_factory.mktemp("frozen"), compile="off",
                      max_num_seqs=8, lease_seconds=2.0, health_interval_s=0.25, stop_grace_s=15,
                      startup_timeout_s=240, first_token_timeout_s=FIRST_TOKEN_TIMEOUT_S,
                      runner_zygote=False)  # SIGSTOP freezes the runner itself, not a zygote launch's stand-in
    s = LocalStack(cfg, progress=None)
    s.start()
    try:
        yield s
    finally:
        for child in s.runners:  # never leave a stopped child behind
            if child.running:
                os.kill(child.proc.pid, signal.SIGCONT)
        s.stop()


def test_requests_complete_within_10_s_while_a_runner_is_frozen_for_20_s(stack: LocalStack) -> None:
    params = sampling_params(max_tokens=8, temperature=0.0)
    with GenerationClient(stack.router_address, security=stack.credentials()) as client:  # both runners serve before the freeze
        served = {client.complete(chat_request([("user", f"Count to {i}.")], params,
                                               routing=generation_pb2.ROUTING_POLICY_ROUND_ROBIN)).runner_id for i in range(4)}
    assert served == {"runner-0", "runner-1"}

    results: list[tuple[str, str, float]] = []
    lock = threading.Lock()

    def one(i: int) -> None:
        start = time.monotonic()
        req = chat_request([("user", f"Say the number {i}.")], params, routing=generation_pb2.ROUTING_POLICY_ROUND_ROBIN)
        try:
            with GenerationClient(stack.router_address, security=stack.credentials()) as c:
                out = c.complete(req, timeout_s=60)
            outcome = ("ok", out.runner_id, time.monotonic() - start)
        except Exception as e:  # noqa: BLE001 - recorded and asserted on below
            outcome = (type(e).__name__, str(e), time.monotonic() - start)
        with lock:
            results.append(outcome)

    frozen = stack.runners[1].proc.pid
    os.kill(frozen, signal.SIGSTOP)
    threads = []
    try:
        end = time.monotonic() + FROZEN_S
        i = 0
        while time.monotonic() < end:  # a request every 0.5 s for the whole freeze
            t = threading.Thread(target=one, args=(i,))
            t.start()
            threads.append(t)
            i += 1
            time.sleep(0.5)
        for t in threads:
            t.join(timeout=BOUND_S + 5)
    finally:
        os.kill(frozen, signal.SIGCONT)
    assert not any(t.is_alive() for t in threads), "a request hung"
    assert len(results) == len(threads) >= 35
    assert all(r[0] == "ok" for r in results), [r for r in results if r[0] != "ok"]
    slowest = max(r[2] for r in results)
    assert slowest <= BOUND_S, sorted(r[2] for r in results)[-5:]
    assert {r[1] for r in results} == {"runner-0"}  # runner-1 answered nothing while frozen

    # thawed, runner-1 re-registers (its heartbeats resume) and serves again
    stack.wait_registered(["runner-0", "runner-1"], timeout_s=30)
    end = time.monotonic() + 30
    seen: set[str] = set()
    with GenerationClient(stack.router_address, security=stack.credentials()) as client:
        while seen != {"runner-0", "runner-1"}:
            assert time.monotonic() < end, seen
            try:
                seen.add(client.complete(chat_request([("user", "Hi")], params,
                                                      routing=generation_pb2.ROUTING_POLICY_ROUND_ROBIN)).runner_id)
            except WarmserveError:
                time.sleep(0.2)
