"""Program fingerprints: stable, sensitive to every field, blind to formatting, UNKNOWN when
incomplete, and UNKNOWN is never stored or matched."""

from __future__ import annotations

import copy
import hashlib
import importlib.metadata
import json
import platform as py_platform
import shutil
import subprocess
import sys
from pathlib import Path

import grpc
import pytest
import torch

import kernel_cache_service.keys as keys_module
from kernel_cache_service.client import KernelCacheClient
from kernel_cache_service.fingerprint import (
    UNKNOWN,
    code_fingerprint,
    code_parts,
    detect_platform,
    fingerprint_of,
    params_fingerprint,
    program_fingerprint,
    program_parts,
)
from kernel_cache_service.store import KernelStore
from services.proto import kernel_cache_pb2 as pb
from services.proto import kernel_cache_pb2_grpc as pb_grpc

REPO = Path(__file__).resolve().parents[2]

SOURCE = '''
import torch


def decode_step(x, w):
    """One step."""
    return torch.nn.functional.silu(x @ w) * 2
'''

# Same program: other whitespace, line breaks, quoting, comments and a trailing comment line.
SOURCE_REFORMATTED = '''import torch
def decode_step( x,w ):  # the hot path
    """One step."""
    return torch.nn.functional.silu(
        x @ w
    ) * 2   # scale
# end of file
'''

# One constant differs: another program.
SOURCE_CHANGED = SOURCE.replace("* 2", "* 3")

PLATFORM = {"machine": "x86_64", "system": "Linux", "isa": "AVX512", "device": "cpu"}
LAYOUT = {"batch_bucket": 8, "block_size": 16, "max_blocks_per_seq": 64}
ARCH = {"hidden_size": 576, "num_layers": 30, "num_heads": 9, "num_kv_heads": 3, "vocab_size": 49152,
        "rope_theta": 100000.0, "tie_embeddings": True}
COMPILE = {"backend": "inductor", "mode": "max-autotune-no-cudagraphs", "dynamic": False,
           "options": {"cpp.simdlen": 512}}
PARAMS = dict(name="llama.decode", platform=PLATFORM, layout=LAYOUT, arch=ARCH, dtype="bfloat16",
              compile_options=COMPILE)
VERSIONS = dict(package_version="0.1.0", torch_version="2.13.0", python_version="3.11")


def _write(tmp_path: Path, name: str, text: str) -> Path:
    """``text`` as ``prog.py`` in directory ``name`` under ``tmp_path``: a file's name is in the
    key (a module's name is), its directory is not."""
    p = tmp_path / name / "prog.py"
    p.parent.mkdir(exist_ok=True)
    p.write_text(text)
    return p


def _is_hex64(s: str) -> bool:
    return len(s) == 64 and all(c in "0123456789abcdef" for c in s)


# ------------------------------------------------------------------ code fingerprint

def test_code_fingerprint_is_hex_and_stable_across_calls_and_processes(tmp_path):
    src = _write(tmp_path, "prog.py", SOURCE)
    a = code_fingerprint([src], **VERSIONS)
    assert _is_hex64(a)
    assert code_fingerprint([str(src)], **VERSIONS) == a  # str and Path name the same file
    script = (f"from kernel_cache_service.fingerprint import code_fingerprint as f;"
              f"print(f([{str(src)!r}], package_version='0.1.0', torch_version='2.13.0', python_version='3.11'))")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True, cwd=REPO)
    assert out.stdout.strip() == a


def test_formatting_and_comments_do_not_change_the_code_fingerprint(tmp_path):
    a = code_fingerprint([_write(tmp_path, "a.py", SOURCE)], **VERSIONS)
    b = code_fingerprint([_write(tmp_path, "b.py", SOURCE_REFORMATTED)], **VERSIONS)
    assert a == b


def test_docstrings_do_not_change_the_code_fingerprint_but_other_strings_do(tmp_path):
    a = code_fingerprint([_write(tmp_path, "a.py", SOURCE)], **VERSIONS)
    redocumented = '"""A module docstring."""\n' + SOURCE.replace('"""One step."""', '"""One decode step, [B, H] f32."""')
    undocumented = SOURCE.replace('    """One step."""\n', "")
    assert code_fingerprint([_write(tmp_path, "b.py", redocumented)], **VERSIONS) == a
    assert code_fingerprint([_write(tmp_path, "c.py", undocumented)], **VERSIONS) == a
    # a string statement that is not the first of its body is kept (and ``x = x`` is new code)
    moved = SOURCE.replace('    """One step."""\n    return', '    x = x\n    """One step."""\n    return')
    assert code_fingerprint([_write(tmp_path, "d.py", moved)], **VERSIONS) != a
    only_docstring = "def f():\n    \"\"\"Nothing.\"\"\"\n"
    assert code_fingerprint([_write(tmp_path, "e.py", only_docstring)], **VERSIONS) == code_fingerprint(
        [_write(tmp_path, "f.py", "def f():\n    pass\n")], **VERSIONS)


def test_a_source_is_canonicalised_once_per_content_in_a_process(tmp_path, monkeypatch):
    """A key computed again (the background build computes several) does not parse the same
    sources again: the canonical form is pure Python and would hold the GIL against the stepping
    thread; an edited file is parsed anew."""
    import kernel_cache_service.fingerprint as fingerprint

    parsed = []
    canonical = fingerprint._canonical_digest
    monkeypatch.setattr(fingerprint, "_DIGESTS", {})
    monkeypatch.setattr(fingerprint, "_canonical_digest", lambda data: parsed.append(data) or canonical(data))
    path = _write(tmp_path, "a.py", SOURCE)
    first = code_fingerprint([path], **VERSIONS)
    assert code_fingerprint([path], **VERSIONS) == first and len(parsed) == 1
    path.write_text(SOURCE_CHANGED)
    assert code_fingerprint([path], **VERSIONS) != first and len(parsed) == 2
    path.write_text(SOURCE)
    assert code_fingerprint([path], **VERSIONS) == first and len(parsed) == 2


def test_a_code_change_changes_the_code_fingerprint(tmp_path):
    a = code_fingerprint([_write(tmp_path, "a.py", SOURCE)], **VERSIONS)
    b = code_fingerprint([_write(tmp_path, "b.py", SOURCE_CHANGED)], **VERSIONS)
    assert a != b


def test_adding_a_source_module_changes_the_code_fingerprint_and_order_does_not(tmp_path):
    a, b = _write(tmp_path, "a.py", SOURCE), _write(tmp_path, "b.py", "Y = 1\n")
    one = code_fingerprint([a], **VERSIONS)
    both = code_fingerprint([a, b], **VERSIONS)
    assert one != both
    assert code_fingerprint([b, a], **VERSIONS) == both


def test_syntax_error_falls_back_to_raw_bytes(tmp_path):
    broken = "def f(:\n    return 1\n"
    a = code_fingerprint([_write(tmp_path, "a.py", broken)], **VERSIONS)
    b = code_fingerprint([_write(tmp_path, "b.py", broken + "  # comment\n")], **VERSIONS)
    assert _is_hex64(a) and _is_hex64(b)
    assert a == code_fingerprint([_write(tmp_path, "c.py", broken)], **VERSIONS)
    assert a != b  # raw bytes: even a comment counts when the file does not parse


@pytest.mark.parametrize("field,value", [("torch_version", "2.12.1"), ("package_version", "0.2.0"),
                                         ("python_version", "3.12")])
def test_each_version_changes_the_code_fingerprint(tmp_path, field, value):
    src = _write(tmp_path, "a.py", SOURCE)
    assert code_fingerprint([src], **{**VERSIONS, field: value}) != code_fingerprint([src], **VERSIONS)


def test_default_versions_are_the_installed_ones(tmp_path):
    src = _write(tmp_path, "a.py", SOURCE)
    explicit = code_fingerprint(
        [src], torch_version=torch.__version__, package_version=importlib.metadata.version("warmserve"),
        python_version=f"{sys.version_info.major}.{sys.version_info.minor}")
    assert code_fingerprint([src]) == explicit


def test_a_module_object_hashes_like_its_file_and_is_named_by_its_module_name(tmp_path):
    by_module = code_parts([keys_module], **VERSIONS)["sources"]
    by_file = code_parts([Path(keys_module.__file__)], **VERSIONS)["sources"]
    assert by_module == {"kernel_cache_service.keys": by_file["keys.py"]}


@pytest.mark.parametrize("sources", [
    pytest.param(lambda tmp: [tmp / "missing.py"], id="missing-file"),
    pytest.param(lambda tmp: [tmp], id="directory"),
    pytest.param(lambda tmp: [sys], id="builtin-module"),
    pytest.param(lambda tmp: [], id="no-sources"),
    pytest.param(lambda tmp: [42], id="not-a-source"),
])
def test_unreadable_sources_make_the_code_fingerprint_unknown(tmp_path, sources):
    assert code_fingerprint(sources(tmp_path), **VERSIONS) == UNKNOWN


def test_missing_package_version_makes_it_unknown(tmp_path, monkeypatch):
    src = _write(tmp_path, "a.py", SOURCE)

    def no_such_package(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "version", no_such_package)
    assert code_fingerprint([src], torch_version="2.13.0") == UNKNOWN


# ------------------------------------------------------------------ params fingerprint

def test_params_fingerprint_is_stable_and_ignores_dict_order():
    a = params_fingerprint(**PARAMS)
    assert _is_hex64(a)
    assert params_fingerprint(**copy.deepcopy(PARAMS)) == a
    reordered = {**PARAMS, "layout": dict(reversed(list(LAYOUT.items()))),
                 "arch": dict(sorted(ARCH.items(), reverse=True))}
    assert params_fingerprint(**reordered) == a


# One case per field: (path into PARAMS, new value).
FIELD_CHANGES = [
    (("name",), "llama.prefill"),
    (("platform", "machine"), "aarch64"),
    (("platform", "system"), "Darwin"),
    (("platform", "isa"), "AVX2"),
    (("platform", "device"), "npu"),
    (("layout", "batch_bucket"), 16),
    (("layout", "block_size"), 32),
    (("layout", "max_blocks_per_seq"), 128),
    (("arch", "hidden_size"), 960),
    (("arch", "num_layers"), 32),
    (("arch", "num_heads"), 15),
    (("arch", "num_kv_heads"), 5),
    (("arch", "vocab_size"), 49153),
    (("arch", "rope_theta"), 10000.0),
    (("arch", "tie_embeddings"), False),
    (("dtype",), "float32"),
    (("compile_options", "backend"), "aot_eager"),
    (("compile_options", "mode"), "default"),
    (("compile_options", "dynamic"), True),
    (("compile_options", "options", "cpp.simdlen"), 256),
]


@pytest.mark.parametrize("path,value", FIELD_CHANGES, ids=[".".join(p) for p, _ in FIELD_CHANGES])
def test_each_params_field_changes_the_key(path, value):
    changed = copy.deepcopy(PARAMS)
    target = changed
    for part in path[:-1]:
        target = target[part]
    assert target[path[-1]] != value
    target[path[-1]] = value
    assert params_fingerprint(**changed) != params_fingerprint(**PARAMS)
    # ... and so does the whole program fingerprint
    full = dict(sources=[keys_module], **{k: v for k, v in PARAMS.items() if k != "name"})
    changed_full = dict(sources=[keys_module], **{k: v for k, v in changed.items() if k != "name"})
    assert (program_fingerprint(changed["name"], **changed_full)
            != program_fingerprint(PARAMS["name"], **full))


def test_adding_a_layout_dim_changes_the_key():
    assert params_fingerprint(**{**PARAMS, "layout": {**LAYOUT, "prefill_chunk": 256}}) != params_fingerprint(**PARAMS)


def test_default_platform_is_detected_from_this_machine():
    detected = detect_platform()
    assert detected["machine"] == py_platform.machine()
    assert detected["system"] == py_platform.system()
    assert detected["isa"] == torch.backends.cpu.get_cpu_capability()
    assert detected["device"] == ("cuda" if torch.cuda.is_available() else "cpu")
    without = {k: v for k, v in PARAMS.items() if k != "platform"}
    assert params_fingerprint(**without) == params_fingerprint(**without, platform=detected)


def test_torch_dtype_is_named_like_its_string():
    assert params_fingerprint(**{**PARAMS, "dtype": torch.bfloat16}) == params_fingerprint(**PARAMS)


@pytest.mark.parametrize("field,value", [
    ("dtype", None),
    ("layout", None),
    ("layout", {**LAYOUT, "block_size": None}),
    ("arch", {**ARCH, "rope_theta": float("nan")}),
    ("arch", {**ARCH, "rope_theta": float("inf")}),
    ("compile_options", {**COMPILE, "options": {"hook": object()}}),
    ("compile_options", {1: "non-string key"}),
    ("platform", {**PLATFORM, "isa": None}),
    ("name", ""),
])
def test_uncomputable_params_make_it_unknown(field, value):
    assert params_fingerprint(**{**PARAMS, field: value}) == UNKNOWN


# ------------------------------------------------------------------ program fingerprint

def test_program_fingerprint_is_the_digest_of_its_parts_record(tmp_path):
    src = _write(tmp_path, "a.py", SOURCE)
    rest = {k: v for k, v in PARAMS.items() if k != "name"}
    fp = program_fingerprint("llama.decode", sources=[src], package_version="0.1.0", torch_version="2.13.0", **rest)
    parts = program_parts("llama.decode", sources=[src], package_version="0.1.0", torch_version="2.13.0", **rest)
    # independently: sha256 of the record's canonical JSON (sorted keys, no spaces)
    text = json.dumps(parts, sort_keys=True, separators=(",", ":"))
    assert fp == fingerprint_of(parts) == hashlib.sha256(text.encode()).hexdigest()
    assert list(parts["sources"]) == ["prog.py"] and parts["layout"] == LAYOUT
    assert parts["python"] == f"{sys.version_info.major}.{sys.version_info.minor}" and parts["torch"] == "2.13.0"
    code = code_fingerprint([src], package_version="0.1.0", torch_version="2.13.0")
    assert _is_hex64(fp) and fp not in (code, params_fingerprint(**PARAMS))
    assert program_fingerprint("llama.decode", sources=[tmp_path / "gone.py"], **rest) == UNKNOWN
    assert program_fingerprint("llama.decode", sources=[src], **{**rest, "dtype": None}) == UNKNOWN
    assert program_parts("llama.decode", sources=[src], **{**rest, "dtype": None}) is None


# ------------------------------------------------------------------ UNKNOWN is never stored or matched

def test_unknown_is_never_stored_or_matched_embedded(tmp_path):
    store = KernelStore(tmp_path / "root")
    art = _write(tmp_path, "art.bin", "compiled")
    result = store.publish("llama.decode", UNKNOWN, art)
    assert result.status == "REJECTED" and "UNKNOWN" in result.reason
    assert store.list() == []
    assert not (tmp_path / "root" / "entries" / "llama.decode" / UNKNOWN).exists()
    # Even an UNKNOWN entry planted on disk by hand is never matched.
    assert store.publish("llama.decode", "abc", art).status == "PUBLISHED"
    shutil.copytree(tmp_path / "root/entries/llama.decode/abc", tmp_path / "root/entries/llama.decode" / UNKNOWN)
    manifest = tmp_path / "root/entries/llama.decode" / UNKNOWN / "manifest.json"
    manifest.write_text(json.dumps({**json.loads(manifest.read_text()), "fingerprint": UNKNOWN}))
    assert store.lookup("llama.decode", UNKNOWN) is None
    assert store.fetch("llama.decode", UNKNOWN, tmp_path / "out") is None
    assert not (tmp_path / "out").exists()
    with store.begin_publish("llama.decode", UNKNOWN, size=8, sha256=hashlib.sha256(b"compiled").hexdigest()) as p:
        p.write(b"compiled")
        result = p.commit()
    assert result.status == "REJECTED" and "UNKNOWN" in result.reason
    assert [e.fingerprint for e in store.list()] == ["abc"]
    client = KernelCacheClient(root=tmp_path / "root")
    assert client.publish("llama.decode", UNKNOWN, art) == "REJECTED"
    assert client.lookup("llama.decode", UNKNOWN) is None


def test_unknown_is_never_stored_or_matched_over_grpc(tmp_path, grpc_cache):
    cache = grpc_cache()
    stub = pb_grpc.KernelCacheStub(grpc.insecure_channel(cache.address))
    key = pb.ProgramKey(name="llama.decode", fingerprint=UNKNOWN)
    data = b"compiled"
    resp = stub.Publish(iter([
        pb.PublishRequest(header=pb.PublishHeader(key=key, size_bytes=len(data),
                                                  sha256=hashlib.sha256(data).hexdigest(), format="file")),
        pb.PublishRequest(chunk=data),
    ]))
    assert resp.status == pb.PublishResponse.STATUS_REJECTED and "UNKNOWN" in resp.reason
    assert stub.Lookup(pb.LookupRequest(key=key)).status == pb.LookupResponse.STATUS_MISS
    assert list(stub.List(pb.ListRequest()).entries) == []
    assert stub.Stat(pb.StatRequest()).publishes == 0
