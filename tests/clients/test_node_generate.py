"""clients/node/generate.js (Node.js, proto-loader on protos/ at runtime) against a router and a
runner on loopback: its streamed greedy completion is the Python ``GenerationClient``'s for the same
prompt and max tokens (text, token ids, finish reason, usage), for a raw-text and a chat prompt;
a request the server refuses exits non-zero printing INVALID_ARGUMENT."""

from __future__ import annotations

import json
import signal
import subprocess
import time
from pathlib import Path

import pytest
from fake_runner import FakeBehaviour, FakeRunner

from services.errors import InvalidArgument
from services.generation_client import (
    GenerationClient,
    GenerationResult,
    chat_request,
    sampling_params,
    text_request,
)

NODE_CLIENT = Path(__file__).resolve().parents[2] / "clients" / "node"
PROMPT = "w5 w6 w7"
MAX_TOKENS = 6


def _reference(address: str, request) -> GenerationResult:
    with GenerationClient(address, fail_fast=True) as client:
        return client.complete(request, timeout_s=30)


def _messages(stdout: str) -> list[dict]:
    return [json.loads(line) for line in stdout.splitlines()]


def _reason(name: str) -> str:
    """``LENGTH`` of ``FINISH_REASON_LENGTH``: the enum values are being renamed (the Python stubs
    may trail the .proto that node reads)."""
    return name.removeprefix("FINISH_REASON_")


def _assert_same(messages: list[dict], ref: GenerationResult) -> None:
    assert "".join(m["text"] for m in messages) == ref.text
    assert [t for m in messages for t in m["token_ids"]] == ref.token_ids
    last = messages[-1]
    assert _reason(last["finish_reason"]) == _reason(ref.finish_reason)
    assert all(m["finish_reason"] == "FINISH_REASON_UNSPECIFIED" for m in messages[:-1])
    assert (last["usage"]["prompt_tokens"], last["usage"]["completion_tokens"]) == (
        ref.prompt_tokens, ref.completion_tokens)
    assert {m["runner_id"] for m in messages} == {ref.runner_id}


def test_generate_streams_the_python_clients_greedy_completion(stack, node_cli) -> None:
    ref = _reference(stack.address, text_request(PROMPT, sampling_params(max_tokens=MAX_TOKENS, temperature=0)))
    # The reference itself: MAX_TOKENS tokens of words, ended by the length limit, from runner-0.
    assert len(ref.token_ids) == ref.completion_tokens == MAX_TOKENS and ref.text.strip()
    assert _reason(ref.finish_reason) == "LENGTH" and ref.runner_id == stack.runner_id

    args = ("--addr", stack.address, "--prompt", PROMPT, "--max-tokens", str(MAX_TOKENS), "--temperature", "0")
    done = node_cli("generate.js", *args, "--json")
    assert done.returncode == 0, done.stderr
    messages = _messages(done.stdout)
    assert len(messages) >= 2  # streamed as deltas, not one answer
    _assert_same(messages, ref)

    # Default output: the deltas as plain text, a newline; the summary on stderr.
    done = node_cli("generate.js", *args)
    assert done.returncode == 0, done.stderr
    assert done.stdout == ref.text + "\n"
    assert done.stderr == (f"[{stack.runner_id}] {MAX_TOKENS} tokens, prompt {ref.prompt_tokens} tokens, "
                           "finish LENGTH\n")

    # The prompt as the positional argument is the same request.
    done = node_cli("generate.js", "--addr", stack.address, "--max-tokens", str(MAX_TOKENS), "--temperature", "0",
                    PROMPT)
    assert (done.returncode, done.stdout) == (0, ref.text + "\n")


def test_generate_chat_prompt_matches_the_python_chat_request(stack, node_cli) -> None:
    content = "w9 w10 w11 w12"
    ref = _reference(stack.address, chat_request([("user", content)], sampling_params(max_tokens=5, temperature=0)))
    assert ref.completion_tokens == len(ref.token_ids) > 0 and ref.text.strip()
    done = node_cli("generate.js", "--addr", stack.address, "--chat", "--prompt", content, "--max-tokens", "5",
                    "--temperature", "0", "--json")
    assert done.returncode == 0, done.stderr
    _assert_same(_messages(done.stdout), ref)


def test_a_request_the_server_refuses_exits_2_with_invalid_argument(stack, node_cli) -> None:
    too_many = stack.max_model_len * 10
    with pytest.raises(InvalidArgument) as refused:  # the Python client is refused the same request
        _reference(stack.address, text_request(PROMPT, sampling_params(max_tokens=too_many)))
    done = node_cli("generate.js", "--addr", stack.address, "--prompt", PROMPT, "--max-tokens", str(too_many))
    assert done.returncode == 2
    assert done.stdout == ""
    assert done.stderr.startswith("generate.js: INVALID_ARGUMENT: ")
    assert str(too_many) in done.stderr and str(refused.value) in done.stderr


def test_bad_flags_exit_2_before_dialling_and_an_unreachable_router_exits_1(node_cli) -> None:
    for args, says in ((["--max-tokens", "0", "x"], "--max-tokens"), (["--seed", "-1", "x"], "--seed"),
                       (["--temperature", "hot", "x"], "--temperature"), ([], "prompt is required"),
                       (["--addr", "nowhere", "x"], "--addr"), (["--bogus", "x"], "bogus")):
        done = node_cli("generate.js", *args)
        assert (done.returncode, done.stdout) == (2, ""), args
        assert done.stderr.startswith("generate.js: error: ") and says in done.stderr, done.stderr
    done = node_cli("generate.js", "--addr", "127.0.0.1:1", "--timeout", "5", "x")
    assert done.returncode == 1 and done.stderr.startswith("generate.js: UNAVAILABLE: "), done.stderr


def test_ctrl_c_cancels_the_call(node_exe) -> None:
    """SIGINT after the first delta: the call is cancelled on the server (the fake runner sees its
    stream end unfinished) and the client exits 130 saying so."""
    runner = FakeRunner("slow", FakeBehaviour(delay_s=0.2))
    try:
        proc = subprocess.Popen([node_exe, str(NODE_CLIENT / "generate.js"), "--addr", runner.address,
                                 "--max-tokens", "40", "x" * 40], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True, cwd="/")
        try:
            assert proc.stdout.read(1) == "x"  # the first delta arrived: the stream is running
            proc.send_signal(signal.SIGINT)
            out, err = proc.communicate(timeout=10)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        assert proc.returncode == 130 and err == "generate.js: cancelled (Ctrl-C)\n", err
        streamed = "x" + out  # the line ended before the error went to stderr; cut short
        assert streamed.endswith("\n") and set(streamed[:-1]) == {"x"} and len(streamed) - 1 < 40
        deadline = time.monotonic() + 5
        while runner.stats.cancelled == 0 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert (runner.stats.requests, runner.stats.cancelled, runner.stats.active) == (1, 1, 0)
    finally:
        runner.stop()
