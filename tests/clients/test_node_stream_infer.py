"""clients/node/stream_infer.js (Node.js, proto-loader on Triton's vendored grpc_service.proto)
against the router's KServe v2 door: ModelStreamInfer with the vLLM backend's tensors streams the
same greedy text as warmserve's own Generate for the same prompt and max tokens."""

from __future__ import annotations

import json

import pytest

from services.errors import InvalidArgument
from services.generation_client import GenerationClient, sampling_params, text_request
from services.model_name import served_model_name

PROMPT = "w5 w6 w7"
MAX_TOKENS = 6


def test_stream_infer_streams_the_greedy_text_of_generate(stack, node_cli) -> None:
    with GenerationClient(stack.address, fail_fast=True) as client:
        ref = client.complete(text_request(PROMPT, sampling_params(max_tokens=MAX_TOKENS, temperature=0)),
                              timeout_s=30)
    assert ref.completion_tokens == MAX_TOKENS and ref.text.strip()  # the reference: 6 greedy tokens of words
    model = served_model_name(stack.model_source)
    assert model == "tiny-llama"  # the checkpoint directory's name
    args = ("--addr", stack.address, "--model", model, "--prompt", PROMPT, "--max-tokens", str(MAX_TOKENS),
            "--temperature", "0")

    done = node_cli("stream_infer.js", *args, "--json")
    assert done.returncode == 0, done.stderr
    responses = [json.loads(line) for line in done.stdout.splitlines()]
    assert "".join(r["text_output"] for r in responses) == ref.text
    assert len([r for r in responses if r["text_output"]]) >= 2  # streamed as deltas, not one answer
    assert [r["final"] for r in responses].count(True) == 1 and responses[-1]["final"]
    assert {r["model_name"] for r in responses} == {model}

    done = node_cli("stream_infer.js", *args)
    assert (done.returncode, done.stdout, done.stderr) == (0, ref.text + "\n", "")

    # Without --model: the one ready model of the server's RepositoryIndex.
    done = node_cli("stream_infer.js", "--addr", stack.address, "--max-tokens", str(MAX_TOKENS), "--temperature", "0",
                    PROMPT)
    assert (done.returncode, done.stdout, done.stderr) == (0, ref.text + "\n", "")


def test_stream_infer_reports_a_refused_request_and_an_unknown_model(stack, node_cli) -> None:
    """A max_tokens beyond the context is refused with Generate's own reason (a Triton in-stream
    ``error_message``): exit 1, the reason on stderr, nothing on stdout. So is a model the server
    does not serve."""
    too_many = stack.max_model_len * 10
    with pytest.raises(InvalidArgument) as refused:
        with GenerationClient(stack.address, fail_fast=True) as client:
            client.complete(text_request(PROMPT, sampling_params(max_tokens=too_many)), timeout_s=30)
    model = served_model_name(stack.model_source)
    done = node_cli("stream_infer.js", "--addr", stack.address, "--model", model, "--prompt", PROMPT,
                    "--max-tokens", str(too_many))
    assert (done.returncode, done.stdout, done.stderr) == (1, "", f"stream_infer.js: {refused.value}\n")

    done = node_cli("stream_infer.js", "--addr", stack.address, "--model", "no-such-model", PROMPT)
    assert (done.returncode, done.stdout) == (1, "")
    assert done.stderr.startswith("stream_infer.js: ") and "'no-such-model'" in done.stderr, done.stderr
