"""Drive a KServe v2 / Triton gRPC endpoint with NVIDIA's official ``tritonclient[grpc]``, used as
a client of a vLLM model on Triton uses it, and print what it saw as one JSON object (test helper).

Run it with the interpreter of the ``.venv-tritonclient`` venv (``make tritonclient``), never the
project's: it imports nothing from warmserve. ``tests/kserve/test_kserve_tritonclient.py``
checks the JSON against the warmserve.v1 ``Generate`` path.

    .venv-tritonclient/bin/python tests/tritonclient_check.py --url 127.0.0.1:50050 \\
        --model tiny-llama --prompt "w5 w6 w7" --max-tokens 8

With ``--cases FILE`` it sends only the requests FILE lists instead (a JSON list of objects:
``name``, ``prompt``, ``sampling`` (the ``sampling_parameters`` object, sent as its JSON text),
``stream`` (true: one request on a stream, false: a unary ``infer`` with
``exclude_input_in_output`` true)) and prints ``{name: what it
saw}``: the stream's responses (as above) or the unary call's ``text`` / ``finish_reason`` /
``num_output_tokens``, or its ``error`` (``status``, ``message``).
"""

from __future__ import annotations

import argparse
import json
import queue
import sys

import numpy as np
import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException


def _inputs(prompt: str | None, *, stream: bool, sampling: dict, exclude_input: bool | None = None) -> list:
    """The vLLM backend's request tensors, built as its own sample client builds them
    (``exclude_input_in_output`` only when ``exclude_input`` is given)."""
    inputs = []
    if prompt is not None:
        inputs.append(grpcclient.InferInput("text_input", [1], "BYTES"))
        inputs[-1].set_data_from_numpy(np.array([prompt.encode("utf-8")], dtype=np.object_))
    inputs.append(grpcclient.InferInput("stream", [1], "BOOL"))
    inputs[-1].set_data_from_numpy(np.array([stream], dtype=bool))
    inputs.append(grpcclient.InferInput("sampling_parameters", [1], "BYTES"))
    inputs[-1].set_data_from_numpy(np.array([json.dumps(sampling).encode("utf-8")], dtype=np.object_))
    for flag in ("return_finish_reason", "return_num_output_tokens"):
        inputs.append(grpcclient.InferInput(flag, [1], "BOOL"))
        inputs[-1].set_data_from_numpy(np.array([True], dtype=bool))
    if exclude_input is not None:
        inputs.append(grpcclient.InferInput("exclude_input_in_output", [1], "BOOL"))
        inputs[-1].set_data_from_numpy(np.array([exclude_input], dtype=bool))
    return inputs


def _error(e: InferenceServerException | None) -> dict | None:
    return None if e is None else {"status": e.status(), "message": e.message()}


def _stream(client, model: str, prompt: str | None, sampling: dict, request_id: str,
            headers: dict | None = None) -> list[dict]:
    """One request on a fresh stream; every callback's result or error, in order."""
    got: queue.Queue = queue.Queue()
    client.start_stream(callback=lambda result, error: got.put((result, error)), headers=headers)
    try:
        client.async_stream_infer(model, _inputs(prompt, stream=True, sampling=sampling), request_id=request_id,
                                  outputs=[grpcclient.InferRequestedOutput("text_output"),
                                           grpcclient.InferRequestedOutput("finish_reason"),
                                           grpcclient.InferRequestedOutput("num_output_tokens")])
    finally:
        client.stop_stream()  # half-closes, then waits for the server to finish the stream
    out = []
    while not got.empty():
        result, error = got.get()
        if error is not None:
            out.append({"error": _error(error)})
            continue
        response = result.get_response()
        out.append({
            "id": response.id,
            "model_name": response.model_name,
            "text": result.as_numpy("text_output")[0].decode("utf-8"),
            "finish_reason": result.as_numpy("finish_reason")[0].decode("utf-8"),
            "num_output_tokens": int(result.as_numpy("num_output_tokens")[0]),
            "final": response.parameters["triton_final_response"].bool_param,
        })
    return out


def _unary(client, model: str, prompt: str, sampling: dict, request_id: str) -> dict:
    """One unary ``infer`` (the prompt excluded from the output): its text, finish reason and
    token count, or its error."""
    try:
        result = client.infer(model, _inputs(prompt, stream=False, sampling=sampling, exclude_input=True),
                              request_id=request_id,
                              outputs=[grpcclient.InferRequestedOutput("text_output"),
                                       grpcclient.InferRequestedOutput("finish_reason"),
                                       grpcclient.InferRequestedOutput("num_output_tokens")])
    except InferenceServerException as e:
        return {"error": _error(e)}
    return {"text": result.as_numpy("text_output")[0].decode("utf-8"),
            "finish_reason": result.as_numpy("finish_reason")[0].decode("utf-8"),
            "num_output_tokens": int(result.as_numpy("num_output_tokens")[0])}


def _cases(url: str, model: str, path: str) -> dict:
    """Each request of the ``--cases`` file, in order: ``{name: what it saw}``."""
    with open(path, encoding="utf-8") as f:
        cases = json.load(f)
    report = {}
    with grpcclient.InferenceServerClient(url=url) as client:
        for i, case in enumerate(cases):
            request_id = f"case-{i}"
            if case["stream"]:
                report[case["name"]] = _stream(client, model, case["prompt"], case["sampling"], request_id)
            else:
                report[case["name"]] = _unary(client, model, case["prompt"], case["sampling"], request_id)
    return report


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", required=True, help="host:port of the gRPC endpoint")
    parser.add_argument("--model", required=True)
    parser.add_argument("--prompt")
    parser.add_argument("--max-tokens", type=int)
    parser.add_argument("--cases", help="a JSON file of requests to send instead (see the module docstring)")
    args = parser.parse_args()
    if args.cases is not None:
        json.dump(_cases(args.url, args.model, args.cases), sys.stdout)
        return 0
    if args.prompt is None or args.max_tokens is None:
        parser.error("--prompt and --max-tokens are required without --cases")
    # Greedy, EOS ignored; numbers as strings, as the vLLM backend's sample client sends them.
    sampling = {"temperature": "0", "max_tokens": str(args.max_tokens), "ignore_eos": True}
    report: dict = {}
    with grpcclient.InferenceServerClient(url=args.url) as client:
        report["server_live"] = client.is_server_live()
        report["server_ready"] = client.is_server_ready()
        report["model_ready"] = client.is_model_ready(args.model)
        report["server_metadata"] = client.get_server_metadata(as_json=True)
        report["model_metadata"] = client.get_model_metadata(args.model, as_json=True)
        report["model_config"] = client.get_model_config(args.model, as_json=True)
        report["stream"] = _stream(client, args.model, args.prompt, sampling, "req-1")
        # A request without text_input: unary (the gRPC status), in a stream (an in-band error,
        # the stream goes on), and in a stream opened with Triton's triton_grpc_error header.
        try:
            client.infer(args.model, _inputs(None, stream=False, sampling=sampling), request_id="bad-1")
            report["bad_unary"] = None
        except InferenceServerException as e:
            report["bad_unary"] = _error(e)
        report["bad_stream"] = _stream(client, args.model, None, sampling, "bad-2")
        report["bad_stream_grpc_error"] = _stream(client, args.model, None, sampling, "bad-3",
                                                  headers={"triton_grpc_error": "true"})
        try:  # as Triton: False for a model it does not serve, not an exception
            report["unknown_model_ready"] = client.is_model_ready("no-such-model")
        except InferenceServerException as e:
            report["unknown_model_ready"] = _error(e)
        try:
            client.get_model_metadata("no-such-model")
            report["unknown_model"] = None
        except InferenceServerException as e:
            report["unknown_model"] = _error(e)
    json.dump(report, sys.stdout)
    return 0


if __name__ == "__main__":
    sys.exit(main())
