"""Sidecar lifecycle: staleness, validation with reasons, repack, atomic publish, locking,
file modes, residency and the cold policy."""

from __future__ import annotations

import json
import os
import re
import stat
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from weights_tiny import write_tiny_checkpoint

from model_families.family import TensorSpec
from model_families.llama import LlamaFamily
from services.errors import FailedPrecondition, InvalidArgument
from weight_service import residency
from weight_service.loader import load_sidecar
from weight_service.prepare import prepare
from weight_service.sidecar import InvalidSidecar, validate_sidecar
from weight_service.sources import resolve_source, source_fingerprint


@pytest.fixture
def ckpt(tmp_path) -> Path:
    write_tiny_checkpoint(tmp_path / "ckpt", shards=2, tied=False)
    return tmp_path / "ckpt"


def _weights(handle) -> Path:
    return handle.path / "model.safetensors"


def test_second_prepare_is_hot_and_same_sidecar(ckpt, tmp_path):
    first = prepare(str(ckpt), root=tmp_path / "sc")
    second = prepare(str(ckpt), root=tmp_path / "sc")
    assert (first.state, second.state) == ("BUILT", "HOT")
    assert second.path == first.path and second.fingerprint == first.fingerprint
    assert second.residency is not None and second.residency >= 0.95
    assert prepare(str(ckpt), root=tmp_path / "sc", force=True).state == "REBUILT"


def test_stale_after_shard_mtime_changes(ckpt, tmp_path):
    first = prepare(str(ckpt), root=tmp_path / "sc")
    shard = ckpt / "model-00001-of-00002.safetensors"
    st = shard.stat()
    os.utime(shard, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))
    with pytest.raises(InvalidSidecar, match="stale: the checkpoint changed"):
        validate_sidecar(first.path, source_fingerprint=source_fingerprint(resolve_source(str(ckpt))))
    second = prepare(str(ckpt), root=tmp_path / "sc")
    assert second.state == "REBUILT" and second.path == first.path
    assert second.fingerprint != first.fingerprint


def test_stale_after_shard_size_changes_with_same_mtime(ckpt, tmp_path):
    first = prepare(str(ckpt), root=tmp_path / "sc")
    shard = ckpt / "model-00002-of-00002.safetensors"
    st = shard.stat()
    save_file(load_file(str(shard)), str(shard), metadata={"padding": "x" * 64})  # same tensors, bigger header
    os.utime(shard, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert shard.stat().st_size != st.st_size and shard.stat().st_mtime_ns == st.st_mtime_ns
    second = prepare(str(ckpt), root=tmp_path / "sc")
    assert second.state == "REBUILT" and second.fingerprint != first.fingerprint


def test_stale_after_packed_name_set_changes(ckpt, tmp_path, monkeypatch):
    first = prepare(str(ckpt), root=tmp_path / "sc")
    specs, globals_ = LlamaFamily.tensor_specs, LlamaFamily.global_tensors
    # A new layout version of the spec that adds one tensor.
    monkeypatch.setattr(LlamaFamily, "tensor_specs", lambda self, c, wd: {
        **specs(self, c, wd), "rope_inv_freq": TensorSpec((4,), torch.float32)})
    monkeypatch.setattr(LlamaFamily, "global_tensors",
                        lambda self, ck, wd="f32": {**globals_(self, ck, wd), "rope_inv_freq": torch.arange(4.0)})
    with pytest.raises(InvalidSidecar, match="packed tensor-name set differs"):
        validate_sidecar(first.path)
    second = prepare(str(ckpt), root=tmp_path / "sc")
    assert second.state == "REBUILT" and second.fingerprint != first.fingerprint
    with load_sidecar(second.path) as sc:
        assert torch.equal(sc.tensors["rope_inv_freq"], torch.arange(4.0))


def _corrupt_truncate(path: Path) -> None:
    os.truncate(path, path.stat().st_size - 100)


def _corrupt_header(path: Path) -> None:
    with open(path, "r+b") as f:
        f.seek(8)
        f.write(b"\x00garbage{{{")


def _corrupt_length(path: Path) -> None:
    with open(path, "r+b") as f:
        f.write((1 << 40).to_bytes(8, "little"))


def _corrupt_dtype(path: Path) -> None:
    raw = path.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    header = raw[8:8 + n].replace(b'"embed_tokens":{"dtype":"F32"', b'"embed_tokens":{"dtype":"F16"', 1)
    assert header != raw[8:8 + n]
    path.write_bytes(raw[:8] + header + raw[8 + n:])


@pytest.mark.parametrize("corrupt,reason", [
    (_corrupt_truncate, "truncated or padded: .* bytes, the header needs"),
    (_corrupt_header, "garbled header: not JSON"),
    (_corrupt_length, "garbled header: it claims 1099511627776 header bytes"),
    (_corrupt_dtype, "tensor embed_tokens has dtype F16, expected F32"),
])
def test_invalid_sidecar_is_rejected_with_reason_and_repacked(ckpt, tmp_path, corrupt, reason):
    first = prepare(str(ckpt), root=tmp_path / "sc")
    corrupt(_weights(first))
    with pytest.raises(InvalidSidecar, match=reason):
        validate_sidecar(first.path)
    with pytest.raises(FailedPrecondition, match=reason):
        load_sidecar(first.path)
    events = []
    second = prepare(str(ckpt), root=tmp_path / "sc", progress=events.append)
    assert second.state == "REBUILT" and second.fingerprint == first.fingerprint
    assert any(e.phase == "validate" and e.message.startswith("repacking:") and
               re.search(reason, e.message) for e in events)
    validate_sidecar(second.path)


def test_checkpoint_modified_during_packing_publishes_nothing(ckpt, tmp_path):
    shard = ckpt / "model-00001-of-00002.safetensors"

    def touch_on_first_layer(event):
        if event.phase == "pack" and event.layers_done == 1:
            st = shard.stat()
            os.utime(shard, ns=(st.st_atime_ns, st.st_mtime_ns + 5_000_000_000))

    with pytest.raises(FailedPrecondition, match="changed while it was packed; nothing was published"):
        prepare(str(ckpt), root=tmp_path / "sc", progress=touch_on_first_layer)
    # no sidecar directory at all: no weights, no tokenizer/config, no temp files
    assert [p for p in (tmp_path / "sc").iterdir() if not p.name.startswith(".")] == []
    assert prepare(str(ckpt), root=tmp_path / "sc").state == "BUILT"


def test_crash_garbage_is_removed(ckpt, tmp_path):
    first = prepare(str(ckpt), root=tmp_path / "sc")
    garbage = first.path / ".tmp-model.safetensors-abc123"
    garbage.write_bytes(b"partial")
    assert prepare(str(ckpt), root=tmp_path / "sc").state == "HOT"
    assert not garbage.exists()


_RACER = textwrap.dedent("""
    import json, sys, time
    from pathlib import Path
    from weight_service.prepare import prepare
    ckpt, root, marker, slow = sys.argv[1], Path(sys.argv[2]), Path(sys.argv[3]), sys.argv[4] == "1"
    packs = []
    def progress(e):
        if e.phase == "pack":
            packs.append(e.layers_done)
            if slow and e.layers_done == 0:
                marker.write_text("packing")
                time.sleep(1.5)
    h = prepare(ckpt, root=root, progress=progress)
    print(json.dumps({"state": h.state, "fingerprint": h.fingerprint, "packed": bool(packs)}))
""")


def test_two_processes_preparing_one_sidecar_pack_once(ckpt, tmp_path):
    marker = tmp_path / "marker"
    args = [str(ckpt), str(tmp_path / "sc"), str(marker)]
    first = subprocess.Popen([sys.executable, "-c", _RACER, *args, "1"], stdout=subprocess.PIPE, text=True)
    try:
        for _ in range(600):  # the first one is packing (and holds the lock) before the second starts
            if marker.exists() or first.poll() is not None:
                break
            time.sleep(0.05)
        assert marker.exists()
        second = subprocess.run([sys.executable, "-c", _RACER, *args, "0"], capture_output=True, text=True, timeout=120)
        out_first, _ = first.communicate(timeout=120)
    finally:
        if first.poll() is None:
            first.kill()
            first.wait()
    assert second.returncode == 0, second.stderr
    a, b = json.loads(out_first), json.loads(second.stdout)
    assert (a["state"], a["packed"]) == ("BUILT", True)
    assert b["state"] in ("HOT", "COLD") and b["packed"] is False
    assert a["fingerprint"] == b["fingerprint"]


@pytest.mark.parametrize("umask,mode", [(0o027, 0o640), (0o002, 0o664)])
def test_published_files_honour_the_umask(ckpt, tmp_path, umask, mode):
    write_tiny_checkpoint(ckpt, shards=2, tied=False, tokenizer=True)
    old = os.umask(umask)
    try:
        handle = prepare(str(ckpt), root=tmp_path / "sc")
    finally:
        os.umask(old)
    names = sorted(os.listdir(handle.path))
    assert names == ["config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"]
    for name in names:
        assert stat.S_IMODE((handle.path / name).stat().st_mode) == mode, name


def test_residency_is_high_after_writing_and_drops_after_eviction(tmp_path):
    big = tmp_path / "big.bin"
    data = os.urandom(8 << 20)
    with open(big, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    assert residency.probe_residency(big) >= 0.95
    sampled = residency.probe_residency(big, window_bytes=64 << 10, windows=8, whole_file_below=0)
    assert sampled >= 0.95
    _evict(big)
    assert residency.advise_willneed(big) is True


def test_sampled_windows_are_page_aligned_and_span_the_file():
    page = 4096
    windows = residency._windows(100 * page + 123, page, 2 * page, 5, 0)
    assert len(windows) == 5 and windows[0][0] == 0
    assert all(off % page == 0 and off + length <= 100 * page + 123 for off, length in windows)
    assert windows[-1][0] + windows[-1][1] >= 100 * page  # the last window reaches the tail
    assert residency._windows(10 * page, page, page, 64, 1 << 20) == [(0, 10 * page)]


def _evict(path: Path) -> None:
    """Drop ``path`` from the page cache (retrying: readahead still in flight re-populates it)."""
    for _ in range(100):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
        if residency.probe_residency(path) < 0.5:
            return
        time.sleep(0.02)
    raise AssertionError(f"could not evict {path} from the page cache")


def test_cold_sidecar_accept_and_reject(ckpt, tmp_path):
    first = prepare(str(ckpt), root=tmp_path / "sc")
    _evict(_weights(first))
    cold = prepare(str(ckpt), root=tmp_path / "sc")
    assert cold.state == "COLD" and cold.residency is not None and cold.residency < 0.95
    assert cold.fingerprint == first.fingerprint
    _evict(_weights(first))
    rejected = prepare(str(ckpt), root=tmp_path / "sc", cold_policy="reject")
    assert rejected.state == "REBUILT" and rejected.residency >= 0.95


def test_probe_failure_falls_back_to_unknown_residency(ckpt, tmp_path, monkeypatch):
    prepare(str(ckpt), root=tmp_path / "sc")

    def no_libc():
        raise OSError("libc unavailable")

    monkeypatch.setattr(residency, "_load_libc", no_libc)
    assert residency.probe_residency(ckpt / "config.json") is None
    handle = prepare(str(ckpt), root=tmp_path / "sc")
    assert (handle.state, handle.residency) == ("COLD", None)
    assert prepare(str(ckpt), root=tmp_path / "sc", cold_policy="reject").state == "REBUILT"


@pytest.mark.parametrize("kwargs,message", [
    ({"source": "/no/such/dir"}, "model source '/no/such/dir' does not exist"),
    ({"source": ""}, "the source is empty"),
    ({"dtype": "f16"}, "dtype must be one of auto, f32, bf16, int8, int4, got 'f16'"),
    ({"cold_policy": "maybe"}, "cold policy must be one of accept, reject"),
])
def test_bad_arguments_are_invalid(ckpt, tmp_path, kwargs, message):
    args = {"source": str(ckpt), **kwargs}
    with pytest.raises(InvalidArgument, match=message):
        prepare(args.pop("source"), root=tmp_path / "sc", **args)


def test_bad_sources_are_invalid(tmp_path):
    (tmp_path / "notes.txt").write_text("x")
    with pytest.raises(InvalidArgument, match="is a file but not a .gguf file"):
        prepare(str(tmp_path / "notes.txt"), root=tmp_path / "sc")
    (tmp_path / "empty").mkdir()
    with pytest.raises(InvalidArgument, match="without config.json"):
        prepare(str(tmp_path / "empty"), root=tmp_path / "sc")
    (tmp_path / "fake.gguf").write_bytes(b"NOTGGUF" * 4)
    with pytest.raises(InvalidArgument, match="not a GGUF v2/v3 file"):
        prepare(str(tmp_path / "fake.gguf"), root=tmp_path / "sc")
