"""Acceptance of signed programs: a runner with trusted keys refuses a tampered program, a
tampered signature and a program signed by an untrusted key before anything is written or
loaded, compiles locally instead, and serves the same tokens as an eager runner. AOTI builds
are replaced by a fake compile (a few bytes) and a fake loader that runs the module eagerly,
so the refusal path is tested without the C++ compiler."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
from runner_tiny import kv_bytes, tiny_args, tiny_config

from kernel_cache_service.client import KernelCacheClient
from model_families.llama import FAMILY as LLAMA
from runner_service.engine import LLMEngine
from runner_service.programs import aoti
from runner_service.sampling_params import SamplingParams
from services.signing import SigningKey, TrustedKeys

ARGS = tiny_args(vocab=96, hidden=32, inter=64, layers=2, heads=4, kv_heads=2, head_dim=8, max_pos=128)
PROMPTS = [[1 + i, 5, 9 + i, 3] for i in range(3)]


class FakeProgram:
    """Stands in for :class:`aoti.AotiProgram`: records the package bytes it was given, then
    runs the module eagerly (same contract: a tuple out)."""

    loaded: list[bytes] = []

    def __init__(self, package: Path, module, device) -> None:
        FakeProgram.loaded.append(Path(package).read_bytes())
        self.module = module

    def __call__(self, caches, *inputs):
        out = self.module(caches, *inputs)
        return out if isinstance(out, tuple) else (out,)


@pytest.fixture(autouse=True)
def fake_aoti(monkeypatch, tmp_path):
    monkeypatch.setenv("WARMSERVE_HOME", str(tmp_path / "home"))  # the programs' work dir is in it
    FakeProgram.loaded = []
    built: list[bytes] = []

    def compile_fake(module, example, dynamic, package, export_lock=None):
        data = b"\x7fELF fake program " + type(module).__name__.encode() + bytes(range(64))
        Path(package).write_bytes(data)
        built.append(data)
        return package

    monkeypatch.setattr(aoti, "compile_aoti", compile_fake)
    monkeypatch.setattr(aoti, "AotiProgram", FakeProgram)
    return built


@pytest.fixture
def keys(tmp_path):
    publisher = SigningKey.generate()
    _key, pub = publisher.write(tmp_path / "keys", "runner-0")
    return publisher, TrustedKeys.load(tmp_path / "keys")


def _engine(kernel_cache, **kw) -> LLMEngine:
    config = tiny_config(compile=kw.pop("compile", "aoti"), max_num_seqs=4, max_model_len=64,
                         kv_cache_bytes=kv_bytes(ARGS, 64))
    return LLMEngine(ARGS, LLAMA.random_weights(ARGS, seed=3), config, kernel_cache=kernel_cache)


def _tokens(eng: LLMEngine) -> list[list[int]]:
    streams = [eng.add_request(SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True), token_ids=p)
               for p in PROMPTS]
    eng.run_until_done()
    out = [s.result(timeout=0).token_ids for s in streams]
    eng.close()
    return out


@pytest.fixture(scope="module")
def eager_tokens():
    return _tokens(_engine(None, compile="off"))


def _programs(eng: LLMEngine) -> str:
    return {p.name: p.detail for p in eng.startup_report.phases}["programs"]


def _publish_all(root: Path, key: SigningKey) -> None:
    """A publisher runner (signing with ``key``) compiles and publishes both programs."""
    eng = _engine(KernelCacheClient(root=root, signing_key=key))
    assert eng.programs.state == "installed" and "PUBLISHED" in _programs(eng)
    eng.close()


def _entries(root: Path) -> list[Path]:
    return sorted(p.parent for p in (root / "entries").rglob("manifest.json"))


def _flip(path: Path, at: int) -> None:
    data = bytearray(path.read_bytes())
    data[at] ^= 1
    path.write_bytes(bytes(data))


def test_a_program_signed_by_a_trusted_key_is_fetched_and_loaded(tmp_path, keys, fake_aoti, eager_tokens):
    key, trusted = keys
    _publish_all(tmp_path / "kc", key)
    published = list(fake_aoti)
    FakeProgram.loaded.clear()
    eng = _engine(KernelCacheClient(root=tmp_path / "kc", trusted_keys=trusted))
    detail = _programs(eng)
    assert "HIT llama.decode.aoti" in detail and "artifacts verified against 1 trusted key" in detail
    assert FakeProgram.loaded == published and len(fake_aoti) == 2  # nothing compiled again
    assert _tokens(eng) == eager_tokens


def test_without_trusted_keys_the_report_says_artifacts_not_verified(tmp_path, keys):
    _publish_all(tmp_path / "kc", keys[0])
    eng = _engine(KernelCacheClient(root=tmp_path / "kc"))
    assert "HIT llama.decode.aoti" in _programs(eng) and _programs(eng).endswith("artifacts not verified")
    eng.close()


def _tamper_program(entry: Path) -> None:
    """One byte of the stored program flipped and the manifest's sha256 rewritten to match:
    the store's own integrity check passes; only the signature can tell."""
    _flip(entry / "blob", 20)
    doc = json.loads((entry / "manifest.json").read_text())
    doc["sha256"] = hashlib.sha256((entry / "blob").read_bytes()).hexdigest()
    (entry / "manifest.json").write_text(json.dumps(doc))


def _tamper_signature(entry: Path) -> None:
    doc = json.loads((entry / "manifest.json").read_text())
    kid, b64 = doc["signature"].split(":")
    raw = bytearray(__import__("base64").b64decode(b64))
    raw[5] ^= 1
    doc["signature"] = f"{kid}:{__import__('base64').b64encode(bytes(raw)).decode()}"
    (entry / "manifest.json").write_text(json.dumps(doc))


@pytest.mark.parametrize("tamper", [_tamper_program, _tamper_signature, None],
                         ids=["program-byte", "signature-byte", "untrusted-key"])
def test_a_tampered_or_foreign_program_is_refused_before_load_and_compiled_here(tmp_path, keys, fake_aoti,
                                                                               eager_tokens, tamper):
    key, trusted = keys
    root = tmp_path / "kc"
    _publish_all(root, key if tamper is not None else SigningKey.generate())  # None: signed by a stranger
    entries = _entries(root)
    assert len(entries) == 2
    for entry in entries:
        if tamper is not None:
            tamper(entry)
    stored = [(e / "blob").read_bytes() for e in entries]
    FakeProgram.loaded.clear()
    from services.paths import warmserve_home

    work = warmserve_home() / "programs"
    eng = _engine(KernelCacheClient(root=root, trusted_keys=trusted, signing_key=key))
    detail = _programs(eng)
    assert eng.programs.state == "installed"
    assert "compiled llama.decode.aoti" in detail and "compiled llama.prefill.aoti" in detail
    assert detail.count("; refused program llama.") == 2, detail
    assert ("not trusted" if tamper is None else "does not match") in detail
    # the loader never saw the stored bytes: only the two programs compiled here
    assert not any(blob in FakeProgram.loaded for blob in stored if blob not in fake_aoti[:2])
    assert FakeProgram.loaded == fake_aoti[2:] and len(FakeProgram.loaded) == 2
    assert not list(work.glob("*.pt2"))  # nothing fetched was written where the loader reads
    assert _tokens(eng) == eager_tokens


def test_a_verifying_runner_without_a_signing_key_publishes_nothing(tmp_path, keys, eager_tokens):
    """Designated builders: a runner that only verifies compiles a missing program for itself and
    leaves the key free for a signed publish (an unsigned entry would be refused everywhere)."""
    _key, trusted = keys
    eng = _engine(KernelCacheClient(root=tmp_path / "kc", trusted_keys=trusted))
    assert "compiled llama.decode.aoti" in _programs(eng) and "(not published)" in _programs(eng)
    assert KernelCacheClient(root=tmp_path / "kc").list() == []
    assert _tokens(eng) == eager_tokens
