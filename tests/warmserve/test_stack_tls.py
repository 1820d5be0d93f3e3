"""``warmserve up --tls``: a throw-away CA and certificate in the home, every daemon and door on
mTLS with them. The command lines (fast), then the real SmolLM2 behind all three doors (slow):
the five chat prompts through the router's Generation, its KServe door and the OpenAI door over
HTTPS, and a plaintext client, a client with another CA's certificate and one with none, refused."""

from __future__ import annotations

import json
import ssl
import struct
import urllib.request
from pathlib import Path

import grpc
import pytest
from real_model_prompts import CHATS

from openai_service.healthcheck import check_http_health, client_tls
from runner_service.tokenizer import Tokenizer
from services.channel import ClientSecurity, open_channel
from services.errors import WarmserveError
from services.generation_client import GenerationClient, chat_request, sampling_params
from services.healthcheck import check_health
from services.ports import KERNEL_CACHE, OPENAI, ROUTER, WEIGHTS
from services.proto.triton import grpc_service_pb2 as kpb
from services.proto.triton import grpc_service_pb2_grpc as kpb_grpc
from services.tls import TLSFiles, make_dev_pki
from warmserve.cli import build_parser
from warmserve.stack import LocalStack
from warmserve.stack_config import StackConfig
from warmserve.up import ready_hint

MAX_TOKENS = 12


def _flags(argv: list[str]) -> dict[str, str]:
    return {a: argv[i + 1] for i, a in enumerate(argv[:-1]) if a.startswith("--tls")}


def test_up_tls_gives_every_daemon_and_door_the_stacks_certificate_and_ca(tmp_path: Path) -> None:
    assert StackConfig.from_args(build_parser().parse_args(["up", "--tls"])).tls is True
    assert StackConfig.from_args(build_parser().parse_args(["up"])).tls is False
    stack = LocalStack(StackConfig(runners=2, base_port=50100, home=tmp_path, openai=True, tls=True), progress=None)
    tls = tmp_path / "tls"
    want = {"--tls-cert": str(tls / "cert.pem"), "--tls-key": str(tls / "key.pem"), "--tls-ca": str(tls / "ca.pem")}
    for name in (KERNEL_CACHE, WEIGHTS, ROUTER, OPENAI):
        assert _flags(stack.commands.service(name)) == want, name
    assert [_flags(stack.runner_argv(i)) for i in range(2)] == [want, want]
    assert stack.security == ClientSecurity(tls=TLSFiles(cert=want["--tls-cert"], key=want["--tls-key"],
                                                         ca=want["--tls-ca"]))
    plain = LocalStack(StackConfig(runners=1, base_port=50100, home=tmp_path, openai=True), progress=None)
    assert not any(_flags(plain.commands.service(n)) for n in (KERNEL_CACHE, WEIGHTS, ROUTER, OPENAI))
    assert not _flags(plain.runner_argv(0)) and plain.security is None


def test_the_ready_hint_of_a_tls_stack_names_its_files(tmp_path: Path) -> None:
    stack = LocalStack(StackConfig(runners=1, base_port=50100, home=tmp_path, tls=True), progress=None)
    stack.runners.append(None)  # type: ignore[arg-type]  # as if started
    tls = tmp_path / "tls"
    assert ready_hint(stack).startswith(f"ready: warmserve generate --addr 127.0.0.1:50100 --tls-ca {tls / 'ca.pem'} "
                                        f"--tls-cert {tls / 'cert.pem'} --tls-key {tls / 'key.pem'} \"Hello!\"")


@pytest.fixture(scope="module")
def tls_stack(tmp_path_factory):
    home = tmp_path_factory.mktemp("tls-stack")
    stack = LocalStack(StackConfig(runners=1, base_port=0, home=home, compile="off", max_num_seqs=8, openai=True,
                                   tls=True, stop_grace_s=15, startup_timeout_s=300), progress=None)
    stack.start()
    yield stack
    stack.stop()


@pytest.fixture(scope="module")
def stranger(tmp_path_factory):
    """A PKI of another CA, for the same names."""
    return make_dev_pki(tmp_path_factory.mktemp("stranger"), ["localhost", "127.0.0.1"])


def _kserve_text(stack: LocalStack, model: str, prompt: str) -> str:
    req = kpb.ModelInferRequest(model_name=model)
    for name, datatype, value in (("text_input", "BYTES", prompt.encode()),
                                  ("sampling_parameters", "BYTES",
                                   json.dumps({"max_tokens": MAX_TOKENS, "temperature": 0}).encode()),
                                  ("exclude_input_in_output", "BOOL", True)):
        req.inputs.add(name=name, datatype=datatype, shape=[1])
        req.raw_input_contents.append(struct.pack("<I", len(value)) + value if datatype == "BYTES" else bytes([value]))
    with open_channel(stack.router_address, security=stack.credentials()) as ch:
        resp = kpb_grpc.GRPCInferenceServiceStub(ch).ModelInfer(req, timeout=120)
    (raw,) = [r for t, r in zip(resp.outputs, resp.raw_output_contents, strict=True) if t.name == "text_output"]
    (n,) = struct.unpack_from("<I", raw)
    return raw[4:4 + n].decode()


def _https(stack: LocalStack, path: str, body: dict | None = None) -> dict:
    pki = stack.commands.pki
    url = f"https://{stack.address(OPENAI)}{path}"
    data = json.dumps(body).encode() if body is not None else None
    key = (stack.home / "auth" / "openai.key").read_text().strip()  # `up` requires its API key
    request = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json",
                                                              "Authorization": f"Bearer {key}"})
    with urllib.request.urlopen(request, timeout=120,
                                context=client_tls(str(pki.ca), str(pki.cert), str(pki.key))) as resp:
        return json.loads(resp.read())


@pytest.mark.slow
def test_up_tls_serves_the_five_chats_through_all_three_doors(tls_stack: LocalStack) -> None:
    stack = tls_stack
    (tokenizer_json,) = (stack.home / "sidecars").rglob("tokenizer.json")
    tokenizer = Tokenizer.from_dir(tokenizer_json.parent)
    model = _https(stack, "/v1/models")["data"][0]["id"]
    for messages in CHATS:
        request = chat_request([(m["role"], m["content"]) for m in messages],
                               sampling_params(max_tokens=MAX_TOKENS, temperature=0.0))
        with GenerationClient(stack.router_address, security=stack.credentials()) as client:
            grpc_text = client.complete(request, timeout_s=120).text
        assert grpc_text.strip(), messages
        door = _https(stack, "/v1/chat/completions", {"model": model, "messages": messages,
                                                       "max_tokens": MAX_TOKENS, "temperature": 0})
        assert door["choices"][0]["message"]["content"] == grpc_text, messages
        assert _kserve_text(stack, model, tokenizer.render_chat(messages)) == grpc_text, messages


@pytest.mark.slow
def test_up_tls_refuses_plaintext_another_ca_and_no_certificate(tls_stack: LocalStack, stranger) -> None:
    stack = tls_stack
    ca = str(stack.commands.pki.ca)
    clients = {
        "plaintext": None,
        "another CA's certificate": ClientSecurity(tls=TLSFiles(cert=str(stranger.cert), key=str(stranger.key), ca=ca)),
        "no certificate": ClientSecurity(tls=TLSFiles(ca=ca)),
    }
    request = chat_request([("user", "Hi!")], sampling_params(max_tokens=4, temperature=0.0))
    for what, security in clients.items():
        with pytest.raises(WarmserveError):  # at the handshake (fail_fast, as `warmserve generate`), or the call
            with GenerationClient(stack.router_address, security=security, fail_fast=True) as client:
                client.complete(request, timeout_s=10)
        for name, address in stack.endpoints().items():
            if name != OPENAI:
                assert check_health(address, timeout_s=2, security=security).startswith("UNREACHABLE"), (what, name)
    assert check_health(stack.router_address, security=stack.security) == "SERVING"
    door = stack.address(OPENAI)
    assert check_http_health(door).startswith("UNREACHABLE")  # plain HTTP to the HTTPS door
    assert check_http_health(door, tls=client_tls(ca, str(stranger.cert), str(stranger.key))).startswith("UNREACHABLE")
    assert check_http_health(door, tls=client_tls(ca)).startswith("UNREACHABLE")
    assert check_http_health(door, tls=client_tls(str(stack.commands.pki.ca), str(stack.commands.pki.cert),
                                                  str(stack.commands.pki.key))) == "SERVING"
    with pytest.raises((ssl.SSLError, OSError)):  # the stranger's CA does not vouch for the door
        urllib.request.urlopen(f"https://{door}/health", timeout=5, context=client_tls(str(stranger.ca)))
    # KServe, on the router's port, refuses the same way
    with open_channel(stack.router_address) as ch, pytest.raises(grpc.RpcError) as e:
        kpb_grpc.GRPCInferenceServiceStub(ch).ServerLive(kpb.ServerLiveRequest(), timeout=5)
    assert e.value.code() == grpc.StatusCode.UNAVAILABLE
