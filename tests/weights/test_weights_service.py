"""The Weights gRPC service on loopback (Prepare, Fetch, List, errors, auth) and the CLI."""

from __future__ import annotations

import hashlib
import subprocess
import sys
import time
from pathlib import Path

import grpc
import pytest
from auth_tokens import make_creds
from weights_tiny import write_tiny_checkpoint

from services.bootstrap import ServerConfig
from services.errors import InvalidArgument, NotFound, Unauthenticated
from services.proto import weights_pb2, weights_pb2_grpc
from weight_service.client import WeightsClient
from weight_service.servicer import build_server
from weight_service.sidecar import validate_sidecar


@pytest.fixture
def ckpt(tmp_path) -> Path:
    write_tiny_checkpoint(tmp_path / "ckpt", shards=2, tied=False, tokenizer=True)
    return tmp_path / "ckpt"


@pytest.fixture
def server(tmp_path):
    srv = build_server(ServerConfig(service="weights", port=0), tmp_path / "server-root", model_roots=[tmp_path])
    srv.start()
    try:
        yield srv
    finally:
        srv.stop()


@pytest.fixture
def client(server):
    c = WeightsClient(server.address)
    try:
        yield c
    finally:
        c.close()


def test_prepare_streams_progress_then_a_valid_handle(client, ckpt):
    events = []
    handle = client.prepare(str(ckpt), dtype="f32", progress=events.append)
    assert handle.state == "BUILT" and handle.family == "llama" and handle.dtype == "f32"
    assert any(e.phase == "pack" and e.layers_total == 2 for e in events)
    assert events[-1].phase == "validate"
    assert [e.layers_done for e in events if e.phase == "pack"] == [0, 1, 2]
    assert max(e.bytes_written for e in events) > 0
    info = validate_sidecar(handle.path, fingerprint=handle.fingerprint)
    assert info.size_bytes == handle.size_bytes
    assert handle.residency is not None and handle.residency >= 0.95
    again_events = []
    again = client.prepare(str(ckpt), progress=again_events.append)
    assert again.state == "HOT" and again.fingerprint == handle.fingerprint and len(again_events) >= 1


def test_prepare_raw_stream_has_files_in_the_final_handle(server, ckpt):
    with grpc.insecure_channel(server.address) as ch:
        events = list(weights_pb2_grpc.WeightsStub(ch).Prepare(weights_pb2.PrepareRequest(source=str(ckpt))))
    assert events[0].HasField("progress") and events[-1].HasField("handle")
    assert all(e.HasField("progress") for e in events[:-1])
    final = events[-1].handle
    assert final.state == weights_pb2.SIDECAR_STATE_BUILT
    assert [f.name for f in final.files] == ["config.json", "tokenizer.json", "tokenizer_config.json",
                                             "model.safetensors"]
    assert final.files[-1].size_bytes == final.size_bytes


def test_prepare_errors_are_invalid_argument(client, server, ckpt, tmp_path):
    missing = tmp_path / "no-such-model"  # inside the model root: outside one, see test_weights_model_roots.py
    with pytest.raises(InvalidArgument, match=f"model source '{missing}' does not exist"):
        client.prepare(str(missing))
    with pytest.raises(InvalidArgument, match="dtype must be one of auto, f32, bf16, int8, int4, got 'int3'"):
        client.prepare(str(ckpt), dtype="int3")
    with grpc.insecure_channel(server.address) as ch, pytest.raises(grpc.RpcError) as err:
        list(weights_pb2_grpc.WeightsStub(ch).Prepare(weights_pb2.PrepareRequest(source=str(ckpt), cold_policy="x")))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT


def test_fetch_into_a_fresh_directory_is_byte_identical_and_valid(client, ckpt, tmp_path):
    handle = client.prepare(str(ckpt))
    local = client.fetch(handle, tmp_path / "runner-cache", chunk_bytes=4096)
    assert local.parent == tmp_path / "runner-cache" and local.name == handle.path.name
    names = sorted(p.name for p in handle.path.iterdir())
    assert sorted(p.name for p in local.iterdir() if not p.name.startswith(".")) == names
    for name in names:
        assert (local / name).read_bytes() == (handle.path / name).read_bytes(), name
    info = validate_sidecar(local, fingerprint=handle.fingerprint)
    assert info.fingerprint == handle.fingerprint
    mtime = (local / "model.safetensors").stat().st_mtime_ns
    time.sleep(0.01)
    assert client.fetch(handle.fingerprint, tmp_path / "runner-cache") == local  # already valid: no download
    assert (local / "model.safetensors").stat().st_mtime_ns == mtime


def test_fetch_first_chunk_carries_sha256_of_every_file(server, client, ckpt):
    handle = client.prepare(str(ckpt))
    with grpc.insecure_channel(server.address) as ch:
        chunks = list(weights_pb2_grpc.WeightsStub(ch).Fetch(
            weights_pb2.WeightsFetchRequest(source=str(ckpt), dtype="f32", chunk_bytes=1000)))
    first = chunks[0].handle
    assert first.fingerprint == handle.fingerprint
    for f in first.files:
        data = (handle.path / f.name).read_bytes()
        assert f.size_bytes == len(data) and f.sha256 == hashlib.sha256(data).hexdigest()
        assert b"".join(c.data for c in chunks[1:] if c.file == f.name) == data
    assert max(len(c.data) for c in chunks[1:]) <= 1000


def test_fetch_unknown_is_not_found(client, server, ckpt):
    with pytest.raises(NotFound, match="no valid sidecar with fingerprint"):
        client.fetch("0" * 64, Path("/nonexistent-never-created"))
    with grpc.insecure_channel(server.address) as ch, pytest.raises(grpc.RpcError) as err:
        list(weights_pb2_grpc.WeightsStub(ch).Fetch(weights_pb2.WeightsFetchRequest(source=str(ckpt))))
    assert err.value.code() == grpc.StatusCode.NOT_FOUND and "call Prepare first" in err.value.details()
    assert not Path("/nonexistent-never-created").exists()


def test_list_reports_prepared_sidecars(client, ckpt):
    assert client.list() == []
    f32 = client.prepare(str(ckpt))
    bf16 = client.prepare(str(ckpt), dtype="bf16")
    listed = {h.fingerprint: h for h in client.list()}
    assert set(listed) == {f32.fingerprint, bf16.fingerprint}
    assert listed[bf16.fingerprint].dtype == "bf16" and listed[f32.fingerprint].size_bytes == f32.size_bytes
    assert all(h.state in ("HOT", "COLD") for h in listed.values())


def test_token_is_required_when_configured(tmp_path, ckpt):
    creds = make_creds(tmp_path / "auth", runner="read")
    srv = build_server(ServerConfig(service="weights", port=0, auth=creds.table), tmp_path / "root")
    srv.start()
    try:
        with WeightsClient(srv.address) as anonymous, pytest.raises(Unauthenticated):
            anonymous.list()
        with WeightsClient(srv.address, security=creds.security("runner")) as authed:
            assert authed.list() == []
    finally:
        srv.stop()


def _warmserve(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    done = subprocess.run([sys.executable, "-m", "warmserve.cli", *args], capture_output=True, timeout=120, cwd=cwd)
    # Decode without newline translation: the bar redraws its line with "\r".
    return subprocess.CompletedProcess(done.args, done.returncode, done.stdout.decode(), done.stderr.decode())


def test_cli_prepack_with_progress_bar_and_bad_source(ckpt, tmp_path):
    out = tmp_path / "out"
    done = _warmserve("prepack", str(ckpt), "--dtype", "bf16", "--out", str(out), cwd=Path(__file__).parents[2])
    assert done.returncode == 0, done.stderr
    # stderr is a pipe, not a terminal: one plain line per phase, no carriage-return bar
    assert "\r" not in done.stderr and "2/2 layers" in done.stderr
    phases = [line.split(":")[0] for line in done.stderr.splitlines()]
    assert "pack" in phases and len(phases) == len(set(phases))
    assert done.stdout.startswith("BUILT ") and "-llama-bf16" in done.stdout
    (sidecar,) = [p for p in out.iterdir() if not p.name.startswith(".")]
    assert validate_sidecar(sidecar).dtype == "bf16"
    again = _warmserve("prepack", str(ckpt), "--dtype", "bf16", "--out", str(out), cwd=Path(__file__).parents[2])
    assert again.returncode == 0 and again.stdout.startswith("HOT ")
    bad = _warmserve("prepack", str(tmp_path / "missing"), "--out", str(out), cwd=Path(__file__).parents[2])
    assert bad.returncode == 2
    assert f"warmserve: error: model source '{tmp_path / 'missing'}' does not exist" in bad.stderr
    (tmp_path / "notes.txt").write_text("x")
    bad = _warmserve("prepack", str(tmp_path / "notes.txt"), "--out", str(out), cwd=Path(__file__).parents[2])
    assert bad.returncode == 2 and "is a file but not a .gguf file" in bad.stderr


def test_progress_bar_redraws_one_line_only_on_a_terminal():
    import io

    from weight_service.progress import ProgressBar, ProgressEvent

    events = [ProgressEvent("read"), *(ProgressEvent("pack", i, 3, i << 20) for i in range(4)), ProgressEvent("validate")]
    for tty in (True, False):
        stream = io.StringIO()
        bar = ProgressBar(stream, tty=tty)
        for e in events:
            bar.update(e)
        bar.finish()
        text = stream.getvalue()
        if tty:
            assert text.count("\r") == len(events) and text.endswith("\n") and text.count("\n") == 1
            assert "[" + "#" * 30 + "] 3/3 layers" in text
        else:
            assert "\r" not in text
            assert text.splitlines() == ["read: 0/0 layers 0.0 MiB", "pack: 0/3 layers 0.0 MiB",
                                         "validate: 3/3 layers 3.0 MiB"]
    assert ProgressBar(io.StringIO())._tty is False  # a StringIO is not a terminal


def test_cli_weights_serve_runs_the_daemon(ckpt, tmp_path):
    from services.ports import free_port

    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "warmserve.cli", "weights", "serve", "--root",
                             str(tmp_path / "root"), "--port", str(port), "--drain-grace", "1",
                             "--model-root", str(ckpt)],
                            cwd=Path(__file__).parents[2], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        with WeightsClient(f"127.0.0.1:{port}", ready_timeout_s=30) as c:
            handle = c.prepare(str(ckpt))
            assert handle.state == "BUILT" and handle.path.parent == tmp_path / "root"
            assert [h.fingerprint for h in c.list()] == [handle.fingerprint]
        proc.terminate()
        assert proc.wait(timeout=30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
