"""The OpenAI door's own defences (issue 23), against a fake router (tests/openai/door_fakes.py):
an oversize body refused before it is read, invalid Unicode a 400 that leaks nothing, no
exception text in a 500, ``/docs`` off unless asked for, the API key on every ``/v1`` route
(health open), the ``Host`` check, 405 with ``Allow``, the router's overload signal as 429, and
HTTPS / mTLS with a throw-away CA (``services.tls.make_dev_pki``)."""

from __future__ import annotations

import asyncio
import json
import socket
import subprocess
import sys
import urllib.error
import urllib.request
from contextlib import contextmanager
from dataclasses import dataclass
from http.client import HTTPConnection
from pathlib import Path

import openai
import pytest
from door_fakes import FAKE_MODEL, fake_router

from openai_service.app import create_app
from openai_service.config import DEFAULT_MAX_BODY_BYTES, OpenAIConfig
from openai_service.daemon import API_KEY_ENV, OpenAIServer, api_key_from
from openai_service.healthcheck import check_http_health, client_tls
from services.channel import ClientSecurity
from services.errors import InvalidArgument
from services.tls import TLSFiles, make_dev_pki

REPO = Path(__file__).resolve().parents[2]
KEY = "sk-test-0123456789"
COMPLETION = {"model": FAKE_MODEL, "prompt": "w5 w6", "max_tokens": 2}
#: Words of Python exception text that must never reach a client.
LEAKS = ("Traceback", "Error:", "UnicodeEncodeError", "surrogates not allowed", "Exception calling application")


@pytest.fixture(scope="module")
def router():
    with fake_router() as (address, servicer):
        yield address, servicer


@contextmanager
def door(router, **config):
    server = OpenAIServer(OpenAIConfig(router=router[0], port=0, **config))
    server.start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="module")
def open_door(router):
    with door(router) as d:
        yield d


@pytest.fixture(scope="module")
def keyed_door(router):
    with door(router, api_key=KEY) as d:
        yield d


def request(server: OpenAIServer, method: str, path: str, body: bytes | dict | None = None,
            headers: dict[str, str] | None = None) -> tuple[int, dict, dict]:
    """(status, headers, JSON body) of one raw HTTP request to ``server``."""
    data = json.dumps(body).encode() if isinstance(body, dict) else body
    conn = HTTPConnection(server.address, timeout=30)
    try:
        conn.request(method, path, body=data, headers={"Content-Type": "application/json", **(headers or {})})
        resp = conn.getresponse()
        return resp.status, dict(resp.headers), json.loads(resp.read())
    finally:
        conn.close()


def assert_error(doc: dict, status: int) -> dict:
    assert set(doc) == {"error"} and set(doc["error"]) == {"message", "type", "param", "code"}, doc
    assert not any(w in doc["error"]["message"] for w in LEAKS), doc
    return doc["error"]


# --- the body limit --------------------------------------------------------------------------------


def _asgi_post(app, chunks, headers: list[tuple[bytes, bytes]], path: str = "/v1/completions") -> tuple[int, dict, int]:
    """POST ``chunks`` (a chunked body) to the ASGI ``app`` in-process: (status, JSON body,
    bytes of the body the app received before it answered)."""
    received = 0
    sent: list[dict] = []
    chunks = iter(chunks)

    async def receive() -> dict:
        nonlocal received
        chunk = next(chunks, None)
        if chunk is None:
            await asyncio.sleep(3600)  # the client keeps the connection open
        received += len(chunk)
        return {"type": "http.request", "body": chunk, "more_body": True}

    async def send(message: dict) -> None:
        sent.append(message)

    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST", "scheme": "http",
             "path": path, "raw_path": path.encode(), "query_string": b"", "root_path": "",
             "headers": [(b"host", b"127.0.0.1"), (b"content-type", b"application/json"), *headers],
             "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 80)}
    asyncio.run(asyncio.wait_for(app(scope, receive, send), 30))
    body = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
    return sent[0]["status"], json.loads(body), received


def _forty_mb(chunk_bytes: int = 64 << 10):
    yield b'{"prompt": "'
    for _ in range((40 << 20) // chunk_bytes):
        yield b"w" * chunk_bytes
    yield b'"}'


def test_a_40_mb_chunked_body_is_refused_once_past_the_limit_never_parsed() -> None:
    app = create_app(OpenAIConfig(router="127.0.0.1:1"))
    status, doc, received = _asgi_post(app, _forty_mb(), headers=[(b"transfer-encoding", b"chunked")])
    error = assert_error(doc, 413)
    assert status == 413 and error["type"] == "RequestTooLargeError" and str(DEFAULT_MAX_BODY_BYTES) in error["message"]
    assert received <= DEFAULT_MAX_BODY_BYTES + (64 << 10)  # read no further than the limit (+ one chunk)


def test_a_declared_oversize_body_is_refused_before_any_byte_is_read(open_door) -> None:
    app = create_app(OpenAIConfig(router="127.0.0.1:1", max_body_bytes=1000))
    status, doc, received = _asgi_post(app, _forty_mb(), headers=[(b"content-length", str(40 << 20).encode())])
    assert (status, received) == (413, 0) and assert_error(doc, 413)["code"] == "request_too_large"
    # Over a socket: the headers alone get the answer; the 40 MB are never sent.
    with socket.create_connection(("127.0.0.1", open_door.port), timeout=10) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                  b"Content-Length: 41943040\r\n\r\n")
        head = s.recv(65536)
    assert head.startswith(b"HTTP/1.1 413 ")
    # Within the limit, a body is served as before.
    status, _, doc = request(open_door, "POST", "/v1/completions", COMPLETION)
    assert status == 200 and doc["choices"][0]["text"] == "ok"


# --- invalid Unicode, and no exception text --------------------------------------------------------


@pytest.mark.parametrize(("path", "body", "param"), [
    ("/v1/completions", b'{"model": "fake-model", "prompt": "w5 \\ud800 w6"}', "prompt"),
    ("/v1/completions", b'{"prompt": "w5", "stop": ["ok", "\\udfff"]}', "stop"),
    ("/v1/completions", b'{"model": "\\ud800", "prompt": "w5"}', "model"),
    ("/v1/completions", b'{"prompt": "w5", "\\ud800": 1}', None),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "hi \\udc80"}]}', "messages"),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": [{"type": "text", "text": "\\ud83d"}]}]}',
     "messages"),
    ("/v1/completions", b'{"prompt": "w5 \xed\xa0\x80"}', None),  # a surrogate's UTF-8-like bytes
    ("/v1/completions", b'{"prompt": "w5 \xff\xfe"}', None),  # not UTF-8 at all
])
def test_invalid_unicode_is_a_400_that_leaks_nothing(open_door, router, path, body, param) -> None:
    calls = router[1].calls
    status, _, doc = request(open_door, "POST", path, body)
    error = assert_error(doc, 400)
    assert status == 400 and error["type"] == "BadRequestError", doc
    if param is not None:
        assert error["param"] == param and "lone surrogate" in error["message"], doc
    assert router[1].calls == calls  # never reached the router


def test_a_500_never_carries_exception_text(router) -> None:
    with door(router) as d:
        router[1].crash = "secret-internal-detail"
        try:
            status, _, doc = request(d, "POST", "/v1/completions", COMPLETION)
        finally:
            router[1].crash = None
        assert status == 500 and "secret" not in json.dumps(doc) and assert_error(doc, 500)

        def broken(_request):
            raise RuntimeError("secret-internal-detail")

        d.app.state.client.generate = broken  # a bug inside the door itself
        status, _, doc = request(d, "POST", "/v1/completions", COMPLETION)
        assert status == 500 and "secret" not in json.dumps(doc) and assert_error(doc, 500)
        assert doc["error"]["message"] == "internal error in the OpenAI door (see its log)"


# --- docs, methods, hosts, overload ----------------------------------------------------------------


def test_docs_are_off_unless_asked_for(open_door, router) -> None:
    for path in ("/docs", "/redoc", "/openapi.json"):
        status, _, doc = request(open_door, "GET", path)
        assert status == 404 and assert_error(doc, 404)["type"] == "NotFoundError", path
    assert "/v1/completions" in open_door.app.openapi()["paths"]  # still there in-process, for tests
    with door(router, enable_docs=True) as d:
        status, _, schema = request(d, "GET", "/openapi.json")
        assert status == 200 and schema == d.app.openapi()
        conn = HTTPConnection(d.address, timeout=30)
        conn.request("GET", "/docs")
        assert conn.getresponse().status == 200
        conn.close()


def test_the_schema_lists_what_the_door_answers(open_door) -> None:
    schema = open_door.app.openapi()
    for path in ("/v1/completions", "/v1/chat/completions"):
        responses = schema["paths"][path]["post"]["responses"]
        assert {"400", "401", "404", "413", "429", "503"} <= set(responses) and "422" not in responses
        assert responses["400"]["content"]["application/json"]["schema"] == {"$ref": "#/components/schemas/ErrorResponse"}
        assert "text/event-stream" in responses["200"]["content"]
    bodies = schema["components"]["schemas"]
    assert bodies["ChatCompletionRequest"]["properties"]["messages"]["minItems"] == 1
    assert all(branch.get("minLength", branch.get("minItems")) == 1
               for branch in bodies["CompletionRequest"]["properties"]["prompt"]["anyOf"])
    assert "HTTPValidationError" not in bodies


def test_a_405_names_the_allowed_methods(open_door) -> None:
    status, headers, doc = request(open_door, "GET", "/v1/completions")
    assert status == 405 and headers["allow"] == "POST" and assert_error(doc, 405)["code"] == 405
    status, headers, _ = request(open_door, "DELETE", "/v1/models")
    assert status == 405 and headers["allow"] == "GET"


def test_only_allowed_hosts_are_answered(router) -> None:
    with door(router, allowed_hosts=("door.example", "*.fleet.example")) as d:
        for host in ("door.example", f"door.example:{d.port}", "a.fleet.example", "DOOR.example"):
            assert request(d, "GET", "/health", headers={"Host": host})[0] == 200, host
        for host in ("evil.example", "fleet.example", "door.example.evil", f"127.0.0.1:{d.port}"):
            status, _, doc = request(d, "GET", "/v1/models", headers={"Host": host})
            assert status == 400 and assert_error(doc, 400)["code"] == "invalid_host", host


def test_an_overloaded_router_is_a_429_other_unavailable_a_503(open_door, router) -> None:
    router[1].overloaded = True
    try:
        for body in (COMPLETION, {**COMPLETION, "stream": True}):
            status, _, doc = request(open_door, "POST", "/v1/completions", body)
            error = assert_error(doc, 429)
            assert (status, error["type"], error["code"]) == (429, "rate_limit_error", 429), doc
            assert "busy" in error["message"]
    finally:
        router[1].overloaded = False
    with door(("127.0.0.1:1", None)) as lonely:  # no router at all: UNAVAILABLE without the signal
        status, _, doc = request(lonely, "POST", "/v1/completions", COMPLETION)
        assert status == 503 and assert_error(doc, 503)["type"] == "ServiceUnavailableError"


# --- the API key ------------------------------------------------------------------------------------


def test_every_v1_route_needs_the_api_key_and_health_stays_open(keyed_door) -> None:
    for method, path, body in (("GET", "/v1/models", None), ("GET", f"/v1/models/{FAKE_MODEL}", None),
                               ("POST", "/v1/completions", COMPLETION),
                               ("POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": "w5"}]}),
                               ("GET", "/v1/nowhere", None)):
        for auth in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}, {"Authorization": f"Basic {KEY}"},
                     {"Authorization": f"Bearer {KEY}x"}):
            status, headers, doc = request(keyed_door, method, path, body, headers=auth)
            error = assert_error(doc, 401)
            assert (status, error["code"], headers["www-authenticate"]) == (401, "invalid_api_key", "Bearer"), path
            assert KEY not in json.dumps(doc)
        status, _, doc = request(keyed_door, method, path, body, headers={"Authorization": f"Bearer {KEY}"})
        assert status == (404 if path == "/v1/nowhere" else 200), (path, doc)
    assert request(keyed_door, "GET", "/health")[0] == 200
    assert check_http_health(keyed_door.address) == "SERVING"
    with openai.OpenAI(base_url=keyed_door.url, api_key=KEY, max_retries=0) as client:
        assert client.completions.create(model=FAKE_MODEL, prompt="w5", max_tokens=2).choices[0].text == "ok"
    with openai.OpenAI(base_url=keyed_door.url, api_key="sk-wrong", max_retries=0) as client:
        with pytest.raises(openai.AuthenticationError):
            client.models.list()


def test_an_unauthenticated_oversize_body_is_refused_as_unauthenticated(keyed_door) -> None:
    status, _, doc = request(keyed_door, "POST", "/v1/completions", b"x" * (DEFAULT_MAX_BODY_BYTES + 1))
    assert status == 401 and assert_error(doc, 401)


@pytest.mark.parametrize("api_key", [KEY, None])
def test_the_open_paths_take_no_body_and_others_need_the_key_before_one_is_read(api_key) -> None:
    app = create_app(OpenAIConfig(router="127.0.0.1:1", api_key=api_key))
    chunked = [(b"transfer-encoding", b"chunked")]
    for path in ("/health", "/metrics"):  # the review's 50 x 4 MiB `POST /health`: refused on its headers
        for headers in (chunked, [(b"content-length", b"4000000")], [(b"content-length", b"1")]):
            status, doc, received = _asgi_post(app, _forty_mb(), headers, path=path)
            error = assert_error(doc, 413)
            assert (status, received, error["message"]) == (413, 0, f"{path} takes no request body"), path
    if api_key is not None:  # any other path, unknown ones included, needs the key first
        for path in ("/nowhere", "/v1/completions", "/health/", "/docs"):
            status, doc, received = _asgi_post(app, _forty_mb(), chunked, path=path)
            assert (status, received, assert_error(doc, 401)["code"]) == (401, 0, "invalid_api_key"), path


def test_an_open_path_with_a_body_is_refused_over_a_socket_and_counted(router) -> None:
    with door(router, api_key=KEY) as d:
        with socket.create_connection(("127.0.0.1", d.port), timeout=10) as s:
            s.sendall(b"POST /health HTTP/1.1\r\nHost: 127.0.0.1\r\nTransfer-Encoding: chunked\r\n\r\n"
                      b"10000\r\n" + b"w" * 4096)  # a chunk that never finishes
            head = s.recv(65536)
        assert head.startswith(b"HTTP/1.1 413 ")
        assert request(d, "GET", "/health")[0] == 200
        assert refused(d) == {"body_bytes": 1}  # (read from GET /metrics, open and bodiless)
        with door(router, api_key=KEY, enable_docs=True) as docs:  # a browser sends no key to the docs
            assert request(docs, "GET", "/openapi.json")[0] == 200


def test_the_api_key_comes_from_a_file_or_the_environment_never_argv(tmp_path) -> None:
    key_file = tmp_path / "api-key"
    key_file.write_text(f"{KEY}\n# anything after the first line is ignored\n")
    assert api_key_from(str(key_file), {}) == KEY
    assert api_key_from(str(key_file), {API_KEY_ENV: "other"}) == KEY  # the file wins
    assert api_key_from(None, {API_KEY_ENV: KEY}) == KEY
    assert api_key_from(None, {}) is None
    (tmp_path / "empty").write_text("\n")
    for path in (tmp_path / "empty", tmp_path / "missing"):
        with pytest.raises(InvalidArgument):
            api_key_from(str(path), {})
    assert KEY not in repr(OpenAIConfig(api_key=KEY))
    done = subprocess.run([sys.executable, "-m", "warmserve.cli", "openai", "serve", "--api-key", KEY], cwd=REPO,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "unrecognized arguments: --api-key" in done.stderr


# --- TLS and mTLS ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class PKI:
    ca: str
    cert: str  # the door's certificate, and a client certificate from the same CA
    key: str
    stranger_cert: str  # a client certificate from another CA
    stranger_key: str


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    ours, other = make_dev_pki(tmp_path_factory.mktemp("pki")), make_dev_pki(tmp_path_factory.mktemp("other-pki"))
    return PKI(str(ours.ca), str(ours.cert), str(ours.key), str(other.cert), str(other.key))


def test_tls_serves_https_and_refuses_plaintext(router, pki) -> None:
    with door(router, tls_cert=pki.cert, tls_key=pki.key) as d:
        assert d.url.startswith("https://")
        assert check_http_health(d.address, tls=client_tls(pki.ca)) == "SERVING"
        assert check_http_health(d.address, timeout_s=5) != "SERVING"  # plaintext HTTP
        req = urllib.request.Request(d.url + "/completions", data=json.dumps(COMPLETION).encode(),
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=30, context=client_tls(pki.ca)) as resp:
            assert json.loads(resp.read())["choices"][0]["text"] == "ok"
        with pytest.raises(urllib.error.URLError):  # a client that trusts another CA refuses the door
            urllib.request.urlopen(d.url + "/models", timeout=30, context=client_tls(pki.stranger_cert))


def test_mtls_requires_a_client_certificate_from_the_ca(router, pki) -> None:
    with door(router, tls_cert=pki.cert, tls_key=pki.key, tls_ca=pki.ca) as d:
        assert check_http_health(d.address, tls=client_tls(pki.ca, pki.cert, pki.key)) == "SERVING"
        assert check_http_health(d.address, tls=client_tls(pki.ca)).startswith("UNREACHABLE")  # no certificate
        stranger = client_tls(pki.ca, pki.stranger_cert, pki.stranger_key)  # another CA's certificate
        assert check_http_health(d.address, tls=stranger).startswith("UNREACHABLE")
        assert check_http_health(d.address, timeout_s=5) != "SERVING"  # plaintext


def test_calls_to_the_router_carry_the_doors_token_and_tls(router, pki) -> None:
    with door(router, router_security=ClientSecurity(token="wst_door-token")) as d:
        assert request(d, "POST", "/v1/completions", COMPLETION)[0] == 200
        assert router[1].authorization == "Bearer wst_door-token"
        assert "wst_door-token" not in repr(d.config)
    mtls = TLSFiles(cert=pki.cert, key=pki.key, ca=pki.ca)
    with fake_router(tls=mtls) as secured:
        with door(secured, router_security=ClientSecurity(tls=mtls)) as d:
            status, _, doc = request(d, "POST", "/v1/completions", COMPLETION)
            assert status == 200 and doc["choices"][0]["text"] == "ok"
        with door(secured) as plaintext:  # a plaintext door cannot reach a TLS router
            assert request(plaintext, "POST", "/v1/completions", COMPLETION)[0] == 503


@pytest.mark.parametrize(("config", "message"), [
    ({"tls_cert": "x.crt"}, "--tls-cert and --tls-key go together"),
    ({"tls_ca": "ca.crt"}, "--tls-ca needs --tls-cert and --tls-key"),
    ({"tls_cert": "/nonexistent.crt", "tls_key": "/nonexistent.key"}, "--tls-cert /nonexistent.crt: no such file"),
    ({"max_body_bytes": 0}, "--max-body-bytes must be >= 1"),
    ({"allowed_hosts": ("a*.example",)}, "--allowed-hosts"),
    ({"api_key": " padded "}, "the API key must not be empty"),
])
def test_bad_guard_settings_are_one_sentence(config, message) -> None:
    with pytest.raises(InvalidArgument, match=message.replace("*", r"\*")):
        OpenAIConfig(**config)


# --- refusals counted -------------------------------------------------------------------------------


def refused(server: OpenAIServer) -> dict[str, float]:
    """``warmserve_refused_total`` by reason, parsed from the door's ``/metrics`` with
    prometheus_client's own text parser."""
    from prometheus_client.parser import text_string_to_metric_families

    conn = HTTPConnection(server.address, timeout=30)
    try:
        conn.request("GET", "/metrics")
        resp = conn.getresponse()
        assert resp.status == 200 and resp.headers["content-type"].startswith("text/plain")
        text = resp.read().decode()
    finally:
        conn.close()
    return {s.labels["reason"]: s.value for f in text_string_to_metric_families(text) if f.name == "warmserve_refused"
            for s in f.samples if s.name == "warmserve_refused_total"}


def test_each_limit_refusal_is_counted_on_metrics(router) -> None:
    with door(router, api_key=KEY, max_body_bytes=4096, allowed_hosts=("127.0.0.1",)) as d:
        assert refused(d) == {}, "nothing refused yet"
        auth = {"Authorization": f"Bearer {KEY}"}
        assert request(d, "GET", "/v1/models", headers={"Host": "evil.example"})[0] == 400
        assert request(d, "GET", "/v1/models")[0] == 401
        assert request(d, "GET", "/v1/models", headers={"Authorization": "Bearer nope"})[0] == 401
        assert request(d, "POST", "/v1/completions", b"x" * 5000, headers=auth)[0] == 413
        assert request(d, "POST", "/v1/completions", b'{"prompt": "\\ud800", "max_tokens": 2}', headers=auth)[0] == 400
        router[1].overloaded = True
        try:
            assert request(d, "POST", "/v1/completions", COMPLETION, headers=auth)[0] == 429
        finally:
            router[1].overloaded = False
        assert request(d, "POST", "/v1/completions", COMPLETION, headers=auth)[0] == 200
        assert request(d, "POST", "/v1/completions", {"prompt": "w5", "max_tokens": -1}, headers=auth)[0] == 400
        assert refused(d) == {"host": 1, "api_key": 2, "body_bytes": 1, "unicode": 1, "overloaded": 1}
