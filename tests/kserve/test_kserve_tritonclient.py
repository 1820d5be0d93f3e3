"""Acceptance: NVIDIA's official ``tritonclient[grpc]``, unmodified, in its own venv
(``.venv-tritonclient``, ``make tritonclient``), talks to a live router + runner through the
KServe v2 door as it talks to a vLLM model on Triton (tests/tritonclient_check.py), and streams
the same greedy text the warmserve.v1 ``Generate`` path gives for the same prompt; and sends the
vLLM backend's structured-output keys, whose answers obey their constraints."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import jsonschema
import pytest
from kserve_stack import MODEL_DIR, TinyStack

from services.generation_client import GenerationClient, sampling_params, text_request

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


SCHEMA = {"type": "object", "properties": {
    "id": {"type": "integer", "minimum": 0, "maximum": 999},
    "colour": {"enum": ["red", "green", "blue"]},
    "ok": {"type": "boolean"},
    "tag": {"type": "string", "pattern": "^[a-z]{1,4}$"},
    "flags": {"type": "array", "items": {"type": "boolean"}, "minItems": 1, "maxItems": 3}},
    "required": ["id", "colour", "ok", "tag", "flags"], "additionalProperties": False}
REGEX = r"[a-c]{2,5}-[0-9]{1,3}"
CHOICES = ["red", "green", "blue", "maybe so"]
#: Greedy unless a case says otherwise; numbers as strings, as the vLLM backend's sample client.
GREEDY = {"temperature": "0", "max_tokens": "100"}


def _case(name: str, prompt: str, constraint: dict, *, stream: bool, **sampling) -> dict:
    return {"name": name, "prompt": prompt, "stream": stream, "sampling": {**GREEDY, **sampling, **constraint}}


#: (request, the check of its output). ``guided_decoding`` as an object (vLLM's
#: ``GuidedDecodingParams``), ``structured_outputs`` as its JSON text, as the vLLM backend reads each.
CASES = [
    _case("regex", "Order number:", {"guided_decoding": {"regex": REGEX}}, stream=False),
    _case("regex_sampled", "Order number:", {"guided_decoding": {"regex": REGEX}}, stream=True,
          temperature="1.0", seed="7"),
    _case("choice", "Pick a colour:", {"guided_decoding": {"choice": CHOICES}}, stream=True),
    _case("json", "A record as JSON:", {"guided_decoding": {"json": SCHEMA}}, stream=False),
    _case("json_text", "Another record:", {"guided_decoding": json.dumps({"json": json.dumps(SCHEMA)})}, stream=True),
    _case("so_json", "A record as JSON:", {"structured_outputs": json.dumps({"json": SCHEMA})}, stream=True),
    _case("so_regex", "Code?", {"structured_outputs": json.dumps({"regex": REGEX})}, stream=False),
    _case("so_choice", "Which?", {"structured_outputs": json.dumps({"choice": CHOICES})}, stream=False),
    _case("bad_schema", "x", {"guided_decoding": {"json": {"type": "object", "properties": {"id": {"type": "integr"}}}}},
          stream=False),
    _case("bad_schema_stream", "x", {"structured_outputs": json.dumps({"json": {"type": "string", "minLength": 5,
                                                                              "maxLength": 2}})}, stream=True),
    _case("bad_regex", "x", {"guided_decoding": {"regex": "[a-"}}, stream=False),
]


def _valid_record(text: str) -> bool:
    jsonschema.validate(json.loads(text), SCHEMA)
    return True


CHECKS = {"regex": lambda t: re.fullmatch(REGEX, t) is not None, "choice": lambda t: t in CHOICES,
          "json": _valid_record}


def test_tritonclient_structured_output_keys_constrain_the_text(tmp_path) -> None:
    """vLLM's ``guided_decoding`` / ``structured_outputs`` (regex, choice, JSON schema) in
    ``sampling_parameters``, sent by the official client unary and streamed, on a model whose
    (byte-level) tokenizer llguidance reads: every answer obeys its constraint, checked with
    Python's ``re`` and ``jsonschema``, ends with ``stop`` (the grammar finished), and the greedy JSON
    is the ``Generate`` path's with the same schema; an invalid schema or regex is
    INVALID_ARGUMENT (unary) or an in-band stream error naming the problem."""
    if not TRITON_PYTHON.exists():
        pytest.fail(f"{TRITON_PYTHON.relative_to(REPO)} is missing: run `make tritonclient`")
    cases = tmp_path / "cases.json"
    cases.write_text(json.dumps(CASES))
    stack = TinyStack(tmp_path, tokenizer="bytes")
    try:
        request = text_request("A record as JSON:", sampling_params(max_tokens=100, temperature=0.0))
        request.sampling.structured.json_schema = json.dumps(SCHEMA)
        with GenerationClient(stack.address) as client:
            reference = client.complete(request, timeout_s=60)
        done = subprocess.run([str(TRITON_PYTHON), str(REPO / "tests" / "tritonclient_check.py"), "--url", stack.address,
                               "--model", MODEL_DIR, "--cases", str(cases)],
                              capture_output=True, text=True, timeout=120, cwd=tmp_path)
    finally:
        stack.close()
    assert done.returncode == 0, done.stderr[-4000:]
    report = json.loads(done.stdout)
    assert list(report) == [c["name"] for c in CASES]

    texts = {}
    for case in CASES:
        name, got = case["name"], report[case["name"]]
        if name.startswith("bad_"):
            continue
        if case["stream"]:
            assert all("error" not in r for r in got), (name, got)
            assert [r["final"] for r in got] == [False] * (len(got) - 1) + [True], (name, got)
            text, reason = "".join(r["text"] for r in got), got[-1]["finish_reason"]
            tokens = sum(r["num_output_tokens"] for r in got)
        else:
            assert "error" not in got, (name, got)
            text, reason, tokens = got["text"], got["finish_reason"], got["num_output_tokens"]
        kind = next(k for k in CHECKS if k in name)
        assert CHECKS[kind](text), (name, text)
        assert reason == "stop" and 0 < tokens < int(GREEDY["max_tokens"]), (name, reason, tokens)
        texts[name] = text

    # The same schema gives the same greedy JSON on the Generate path, through either key.
    assert reference.finish_reason == "STOP" and _valid_record(reference.text)
    assert texts["json"] == texts["so_json"] == reference.text

    assert report["bad_schema"]["error"]["status"] == "StatusCode.INVALID_ARGUMENT"
    assert "json schema is not valid" in report["bad_schema"]["error"]["message"]
    assert "Invalid type: integr" in report["bad_schema"]["error"]["message"]
    (in_band,) = report["bad_schema_stream"]
    assert "minLength (5) is greater than maxLength (2)" in in_band["error"]["message"]
    assert report["bad_regex"]["error"]["status"] == "StatusCode.INVALID_ARGUMENT"
    assert "unclosed character class" in report["bad_regex"]["error"]["message"]
