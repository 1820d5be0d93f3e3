"""``services.s3``: ``s3://`` URLs, and the object-store operations both services build on, against
a real S3 server (moto) on loopback: conditional single and multipart uploads, verified
downloads, conditional deletes, and the start-up check's sentences for a missing bucket, denied
access, an unreachable endpoint and an endpoint that ignores conditional writes (the last two
from a tiny fake endpoint)."""

from __future__ import annotations

import hashlib
import io
import os
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from services.errors import InvalidArgument
from services.s3 import ObjectStore
from services.s3_errors import CorruptObject
from services.s3_location import S3Location, make_client, parse_s3_url


@pytest.mark.parametrize("url, bucket, prefix", [
    ("s3://warm-cache", "warm-cache", ""),
    ("s3://warm-cache/", "warm-cache", ""),
    ("s3://warm.cache-1/team/prod", "warm.cache-1", "team/prod"),
    ("  S3://abc/x=1/y+z/  ", "abc", "x=1/y+z"),
])
def test_good_urls_parse(url, bucket, prefix):
    loc = parse_s3_url(url)
    assert (loc.bucket, loc.prefix) == (bucket, prefix)
    assert loc.key("kernel-cache", "entries/a") == "/".join(p for p in (prefix, "kernel-cache", "entries/a") if p)


@pytest.mark.parametrize("url, needle", [
    ("", "empty"),
    ("https://bucket/x", "must start with s3://"),
    ("s3://", "names no bucket"),
    ("s3:///prefix", "names no bucket"),
    ("s3://ab", "not a valid S3 bucket name"),
    ("s3://Upper/x", "not a valid S3 bucket name"),
    ("s3://-bucket/x", "not a valid S3 bucket name"),
    ("s3://a..b/x", "not a valid S3 bucket name"),
    ("s3://bucket/a//b", "empty path segment"),
    ("s3://bucket/a/../b", "must not be '.' or '..'"),
    ("s3://bucket/a b", "may only use"),
    ("s3://bucket/x?versionId=1", "query or fragment"),
])
def test_bad_urls_are_invalid_argument(url, needle):
    with pytest.raises(InvalidArgument, match=needle.replace("?", r"\?")):
        parse_s3_url(url)


def _store(s3, **kwargs) -> ObjectStore:
    return ObjectStore(S3Location(s3.bucket, "team/objects"), make_client(), **kwargs)


def test_a_conditional_put_has_exactly_one_winner_and_carries_size_and_sha(s3, tmp_path):
    store = _store(s3)
    first, second = tmp_path / "first", tmp_path / "second"
    first.write_bytes(b"first" * 1000)
    second.write_bytes(b"second")
    assert store.put_file("k", first) is True
    assert store.put_file("k", second) is False  # the key is taken: nothing replaced
    head = store.head("k")
    assert (head.size, head.metadata["size-bytes"], head.metadata["sha256"]) == (
        5000, "5000", hashlib.sha256(b"first" * 1000).hexdigest())
    sink = io.BytesIO()
    assert store.download("k", sink).etag == head.etag and sink.getvalue() == b"first" * 1000
    assert store.download("missing", io.BytesIO()) is None and store.head("missing") is None


def test_a_multipart_upload_is_conditional_too_and_leaves_no_parts(s3, tmp_path):
    store = _store(s3, multipart_bytes=6 << 20, part_bytes=5 << 20)
    data = os.urandom(11 << 20)  # three parts: 5 + 5 + 1 MiB
    big = tmp_path / "big"
    big.write_bytes(data)
    assert store.put_file("big", big) is True
    assert store.put_file("big", big) is False  # the conditional complete loses; its parts are aborted
    assert s3.client.list_multipart_uploads(Bucket=s3.bucket).get("Uploads", []) == []
    sink = io.BytesIO()
    store.download("big", sink)
    assert hashlib.sha256(sink.getvalue()).digest() == hashlib.sha256(data).digest()


@pytest.mark.parametrize("tamper, needle", [
    (lambda body, meta: (body[:-1] + bytes([body[-1] ^ 1]), meta), "metadata says"),
    (lambda body, meta: (body[:10], meta), "read 10 bytes"),
    (lambda body, meta: (body, {k: v for k, v in meta.items() if k != "sha256"}), "missing or garbled"),
])
def test_a_download_that_does_not_match_its_metadata_is_corrupt(s3, tamper, needle):
    store = _store(s3)
    store.put_bytes("k", b"0123456789" * 100)
    key = "team/objects/k"
    meta = s3.client.head_object(Bucket=s3.bucket, Key=key)["Metadata"]
    body, meta = tamper(s3.client.get_object(Bucket=s3.bucket, Key=key)["Body"].read(), meta)
    s3.client.put_object(Bucket=s3.bucket, Key=key, Body=body, Metadata=meta)
    with pytest.raises(CorruptObject, match=needle) as e:
        store.download("k", io.BytesIO())
    assert e.value.key == "k" and e.value.etag == store.head("k").etag


def test_a_delete_conditional_on_the_etag_spares_a_replaced_object(s3):
    store = _store(s3)
    store.put_bytes("k", b"old")
    old = store.head("k").etag
    store.delete("k")
    store.put_bytes("k", b"new")
    assert store.delete("k", etag=old) is False and store.head("k") is not None
    assert store.delete("k", etag=store.head("k").etag) is True and store.head("k") is None
    assert [o.key for o in store.list()] == []


def test_check_passes_on_a_good_bucket_and_leaves_nothing(s3):
    _store(s3).check()
    assert s3.keys() == []


def test_check_names_a_missing_bucket(s3):
    store = ObjectStore(parse_s3_url("s3://warmserve-missing-bucket/x"), make_client())
    with pytest.raises(InvalidArgument, match="bucket 'warmserve-missing-bucket' does not exist at http://127.0.0.1"):
        store.check()


class _FakeS3(BaseHTTPRequestHandler):
    """An endpoint that answers every request with ``status`` (403: AccessDenied) or, with 200,
    accepts every write (so it ignores If-None-Match)."""

    status = 403

    def _answer(self) -> None:
        length = int(self.headers.get("Content-Length") or 0)
        if length:
            self.rfile.read(length)
        if self.status == 403:
            body = b"<Error><Code>AccessDenied</Code><Message>Access Denied</Message></Error>"
            self.send_response(403)
            self.send_header("Content-Type", "application/xml")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(body)
            return
        self.send_response(204 if self.command == "DELETE" else 200)
        self.send_header("ETag", '"abc"')
        self.send_header("Content-Length", "0")
        self.end_headers()

    do_GET = do_PUT = do_HEAD = do_DELETE = do_POST = _answer

    def log_message(self, *args) -> None:
        pass


@pytest.fixture
def fake_endpoint(monkeypatch):
    """Factory: ``fake_endpoint(status)`` serves :class:`_FakeS3` on loopback and points boto3 at it."""
    servers = []

    def start(status: int) -> str:
        handler = type("Handler", (_FakeS3,), {"status": status})
        server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
        threading.Thread(target=server.serve_forever, daemon=True).start()
        servers.append(server)
        endpoint = f"http://127.0.0.1:{server.server_address[1]}"
        for name, value in {"AWS_ENDPOINT_URL": endpoint, "AWS_ACCESS_KEY_ID": "x", "AWS_SECRET_ACCESS_KEY": "y",
                            "AWS_DEFAULT_REGION": "us-east-1", "AWS_MAX_ATTEMPTS": "1"}.items():
            monkeypatch.setenv(name, value)
        monkeypatch.delenv("AWS_ENDPOINT_URL_S3", raising=False)
        return endpoint

    yield start
    for server in servers:
        server.shutdown()
        server.server_close()


def test_check_names_denied_access(fake_endpoint):
    endpoint = fake_endpoint(403)
    with pytest.raises(InvalidArgument, match="access to s3://warm-bucket/x at .* denied") as e:
        ObjectStore.from_url("s3://warm-bucket/x").check()
    assert endpoint in str(e.value)


def test_check_refuses_an_endpoint_that_ignores_conditional_writes(fake_endpoint):
    fake_endpoint(200)
    with pytest.raises(InvalidArgument, match="ignores conditional writes"):
        ObjectStore.from_url("s3://warm-bucket/x").check()


def test_check_names_an_unreachable_endpoint(monkeypatch):
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:1")
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "1")
    monkeypatch.delenv("AWS_ENDPOINT_URL_S3", raising=False)
    for name, value in {"AWS_ACCESS_KEY_ID": "x", "AWS_SECRET_ACCESS_KEY": "y", "AWS_DEFAULT_REGION": "us-east-1"}.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(InvalidArgument, match="cannot reach the object store .*127.0.0.1:1"):
        ObjectStore.from_url("s3://warm-bucket/x").check()
