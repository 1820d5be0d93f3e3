"""Signed sidecars: the weight service (or a runner packing its own) signs a manifest of every
file and tensor; a runner with trusted keys checks it before mapping anything, refuses a
flipped tensor byte, a flipped manifest byte, an unsigned or foreign-signed sidecar, then
repacks (or downloads again) and serves the same text; a verified sidecar is remembered by
file identity so a warm launch does not rehash it."""

from __future__ import annotations

import mmap
import os
from pathlib import Path

import pytest
from weights_tiny import write_tiny_checkpoint

from services.bootstrap import ServerConfig
from services.errors import Untrusted
from services.signing import SigningKey, TrustedKeys
from weight_service import loader, manifest
from weight_service.client import WeightsClient
from weight_service.manifest import sign_sidecar, verify_sidecar
from weight_service.prepare import prepare
from weight_service.servicer import build_server
from weight_service.sidecar import MANIFEST_FILE, SIGNATURE_FILE, WEIGHTS_FILE, validate_sidecar


@pytest.fixture
def ckpt(tmp_path) -> Path:
    write_tiny_checkpoint(tmp_path / "ckpt", tokenizer=True)
    return tmp_path / "ckpt"


@pytest.fixture
def keys(tmp_path):
    key = SigningKey.generate()
    key.write(tmp_path / "trust", "weights")
    return key, TrustedKeys.load(tmp_path / "trust")


def _flip(path: Path, at: int) -> None:
    with open(path, "r+b") as f:
        f.seek(at)
        b = f.read(1)
        f.seek(at)
        f.write(bytes([b[0] ^ 1]))


@pytest.fixture
def mapped(monkeypatch):
    """Every weights file ``load_sidecar`` maps, as bytes read at mapping time."""
    seen: list[bytes] = []
    real = mmap.mmap

    def spy(fileno, length, *a, **kw):
        if fileno >= 0:
            seen.append(os.pread(fileno, os.fstat(fileno).st_size, 0))
        return real(fileno, length, *a, **kw)

    monkeypatch.setattr(loader.mmap, "mmap", spy)
    return seen


def test_prepare_signs_once_and_a_warm_verification_is_remembered(tmp_path, ckpt, keys, monkeypatch):
    key, trusted = keys
    handle = prepare(str(ckpt), root=tmp_path / "sc", signing_key=key)
    assert (handle.path / MANIFEST_FILE).is_file() and (handle.path / SIGNATURE_FILE).is_file()
    signed_at = (handle.path / MANIFEST_FILE).stat().st_mtime_ns
    again = prepare(str(ckpt), root=tmp_path / "sc", signing_key=key)  # current: not rewritten
    assert again.state == "HOT" and (handle.path / MANIFEST_FILE).stat().st_mtime_ns == signed_at
    # a sidecar whose manifest is not this key's is repacked, never signed as found
    assert prepare(str(ckpt), root=tmp_path / "sc", signing_key=SigningKey.generate()).state == "REBUILT"
    handle = prepare(str(ckpt), root=tmp_path / "sc", signing_key=key)
    assert handle.state == "REBUILT"
    info = validate_sidecar(handle.path)
    assert verify_sidecar(info, trusted) == f"sidecar verified (key {key.key_id})"

    def no_rehash(*a):
        raise AssertionError("a remembered sidecar was rehashed")

    with monkeypatch.context() as m:
        m.setattr(manifest, "_compare", no_rehash)
        assert verify_sidecar(info, trusted).endswith("remembered)")
        os.utime(handle.path / WEIGHTS_FILE)  # another identity: the record no longer applies
        with pytest.raises(AssertionError, match="rehashed"):
            verify_sidecar(info, trusted)
    assert verify_sidecar(info, trusted) == f"sidecar verified (key {key.key_id})"


def _tamper(path: Path, how: str, other: SigningKey) -> None:
    info = validate_sidecar(path)
    if how == "tensor":
        _flip(path / WEIGHTS_FILE, info.data_start + 40)
    elif how == "manifest":
        _flip(path / MANIFEST_FILE, 60)
    elif how == "tokenizer":
        _flip(path / "tokenizer.json", 30)
    elif how == "unsigned":
        (path / SIGNATURE_FILE).unlink()
    elif how == "untrusted":
        (path / MANIFEST_FILE).unlink()
        sign_sidecar(info, other)


@pytest.mark.parametrize("how", ["tensor", "manifest", "tokenizer", "unsigned", "untrusted"])
def test_a_tampered_sidecar_is_refused_before_it_is_mapped(tmp_path, ckpt, keys, mapped, how):
    key, trusted = keys
    handle = prepare(str(ckpt), root=tmp_path / "sc", signing_key=key)
    loader.load_sidecar(handle.path, trusted).close()  # verified and remembered first
    mapped.clear()
    _tamper(handle.path, how, SigningKey.generate())
    with pytest.raises(Untrusted):
        loader.load_sidecar(handle.path, trusted)
    assert mapped == []


def test_without_trusted_keys_a_sidecar_loads_unverified(tmp_path, ckpt):
    handle = prepare(str(ckpt), root=tmp_path / "sc")
    with loader.load_sidecar(handle.path) as sidecar:
        assert sidecar.trust == "artifacts not verified"


def _runner_args(ckpt: Path, sidecars: Path, *extra: str):
    from warmserve.cli import build_parser

    return build_parser().parse_args(["runner", "serve", "--model", str(ckpt), "--sidecar-dir", str(sidecars),
                                      "--compile", "off", "--device", "cpu", "--dtype", "f32",
                                      "--kv-cache-bytes", str(1 << 20), "--max-model-len", "64", *extra])


def _text(eng) -> tuple[list[int], str]:
    from runner_service.sampling_params import SamplingParams

    stream = eng.add_request(SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True), text="w5 w9 w3")
    eng.run_until_done()
    out = stream.result(timeout=0)
    eng.close()
    return out.token_ids, out.text


def _load(args, trusted, key):
    from runner_service.daemon import engine_config_from_args, load_engine

    return load_engine(args, engine_config_from_args(args), None, None, key, trusted)


@pytest.mark.parametrize("how", ["tensor", "manifest"])
def test_a_runner_refuses_a_tampered_local_sidecar_repacks_it_and_serves_the_same_text(tmp_path, ckpt, mapped,
                                                                                       how):
    key = SigningKey.generate()  # the runner packs its own sidecar and signs it; its .pub is trusted
    key.write(tmp_path / "trust", "runner-0")
    trusted = TrustedKeys.load(tmp_path / "trust")
    args = _runner_args(ckpt, tmp_path / "sc")
    first = _load(args, trusted, key)
    assert "sidecar verified" in {p.name: p.detail for p in first.startup_report.phases}["weights"]
    want = _text(first)
    pristine = mapped[0]
    sidecar = next(p for p in (tmp_path / "sc").iterdir() if not p.name.startswith("."))
    _tamper(sidecar, how, key)
    mapped.clear()
    eng = _load(args, trusted, key)
    assert mapped == [pristine]  # the tampered bytes were never mapped; the repacked ones were
    # a flipped tensor byte is found by the runner's check (then repacked); a broken manifest
    # already by its own prepare, which repacks rather than sign bytes it did not just pack
    detail = {p.name: p.detail for p in eng.startup_report.phases}["sidecar"]
    assert ("refused the one found" if how == "tensor" else "REBUILT") in detail
    assert _text(eng) == want and want[1]


def test_a_signed_sidecar_travels_through_weights_fetch_and_a_tampered_copy_is_fetched_again(tmp_path, ckpt,
                                                                                            keys, mapped):
    key, trusted = keys
    server = build_server(ServerConfig(service="weights", port=0), tmp_path / "server-root", model_roots=[ckpt.parent],
                          signing_key=key)
    server.start()
    try:
        with WeightsClient(server.address) as client:
            local = client.fetch(client.prepare(str(ckpt)), tmp_path / "runner")
        assert (local / MANIFEST_FILE).is_file() and (local / SIGNATURE_FILE).is_file()
        loader.load_sidecar(local, trusted).close()
        pristine = mapped[0]
        _flip(local / WEIGHTS_FILE, validate_sidecar(local).data_start + 8)
        mapped.clear()
        args = _runner_args(ckpt, tmp_path / "runner", "--weights", server.address)
        eng = _load(args, trusted, None)
        assert mapped == [pristine]
        assert "sidecar verified" in {p.name: p.detail for p in eng.startup_report.phases}["weights"]
        eng.close()
    finally:
        server.stop()
