"""Acceptance: NVIDIA's official ``tritonclient[grpc]``, unmodified, in its own venv
(``.venv-tritonclient``, ``make tritonclient``), talks to a live router + runner through the
KServe v2 door as it talks to a vLLM model on Triton (tests/tritonclient_check.py), and streams
the same greedy text the warmserve.v1 ``Generate`` path gives for the same prompt."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
from kserve_stack import MODEL_DIR, TinyStack

pytestmark = pytest.mark.usefixtures("one_torch_thread")

REPO = Path(__file__).resolve().parents[2]
TRITON_PYTHON = REPO / ".venv-tritonclient" / "bin" / "python"
PROMPT = "w5 w6 w7"
MAX_TOKENS = 8


def test_tritonclient_streams_the_generate_paths_greedy_text(tmp_path) -> None:
    if not TRITON_PYTHON.exists():
        pytest.fail(f"{TRITON_PYTHON.relative_to(REPO)} is missing: run `make tritonclient` (make test does) to "
                    f"install the official tritonclient[grpc] in its own venv")
    stack = TinyStack(tmp_path)
    try:
        text, _ = stack.greedy(PROMPT, MAX_TOKENS)
        done = subprocess.run([str(TRITON_PYTHON), str(REPO / "tests" / "tritonclient_check.py"), "--url", stack.address,
                               "--model", MODEL_DIR, "--prompt", PROMPT, "--max-tokens", str(MAX_TOKENS)],
                              capture_output=True, text=True, timeout=120, cwd=tmp_path)
    finally:
        stack.close()
    assert done.returncode == 0, done.stderr[-4000:]
    report = json.loads(done.stdout)

    assert (report["server_live"], report["server_ready"], report["model_ready"]) == (True, True, True)
    assert report["server_metadata"]["name"] == "warmserve"
    meta = report["model_metadata"]
    assert (meta["name"], meta["versions"], meta["platform"]) == (MODEL_DIR, ["1"], "vllm")
    assert {i["name"]: (i["datatype"], i["shape"]) for i in meta["inputs"]}["text_input"] == ("BYTES", ["1"])
    assert {o["name"] for o in meta["outputs"]} >= {"text_output"}
    assert report["model_config"]["config"]["model_transaction_policy"] == {"decoupled": True}

    stream = report["stream"]
    assert all("error" not in r for r in stream), stream
    assert "".join(r["text"] for r in stream) == text
    assert [r["final"] for r in stream] == [False] * (len(stream) - 1) + [True]
    assert {(r["id"], r["model_name"]) for r in stream} == {("req-1", MODEL_DIR)}
    assert stream[-1]["finish_reason"] == "length"
    assert sum(r["num_output_tokens"] for r in stream) == MAX_TOKENS

    # A request without text_input: INVALID_ARGUMENT as a unary call's status, an in-band stream
    # error (tritonclient gives those no status), and the status again with triton_grpc_error.
    assert report["bad_unary"]["status"] == "StatusCode.INVALID_ARGUMENT"
    assert "missing required input 'text_input'" in report["bad_unary"]["message"]
    (in_band,) = report["bad_stream"]
    assert "missing required input 'text_input'" in in_band["error"]["message"]
    (as_status,) = report["bad_stream_grpc_error"]
    assert as_status["error"]["status"] == "StatusCode.INVALID_ARGUMENT"
    assert report["unknown_model_ready"] is False
    assert report["unknown_model"]["status"] == "StatusCode.NOT_FOUND"
