"""Why a runner's program key misses: ``warmserve cache explain`` names every fingerprint part that
differs (each part of a real runner's record flipped in turn), the runner's programs phase names
them after a MISS, and what a launch's place does not change the program (ports, runner ids,
homes, cache paths) is no part at all: a relocated cache still HITs."""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import pytest
import torch
from test_runner_programs import make_runner

from kernel_cache_service.client import KernelCacheClient
from kernel_cache_service.fingerprint import PARTS, known_parts
from runner_service.programs import aoti
from runner_service.programs.key import program_key
from runner_service.programs.load import load_programs
from warmserve.cli import main

HEX = "0123456789abcdef"


@pytest.fixture(scope="module")
def real():
    """``(name, fingerprint, record)`` of a tiny runner's decode program, as the runner computes it."""
    name, fp = program_key(make_runner().program_spec(), "aoti")
    return name, fp, json.loads(known_parts(fp))


def _leaves(value, path=()):
    """``(keys, value)`` of every leaf (a non-object value, or an empty object), walked here
    independently of the code under test."""
    if isinstance(value, dict) and value:
        for k, v in value.items():
            yield from _leaves(v, (*path, k))
    else:
        yield path, value


def _path_name(keys) -> str:
    """The documented naming: keys joined by '.', one holding '.' or '[' written [key]."""
    out = ""
    for k in keys:
        seg = f"[{k}]" if "." in k or "[" in k else k
        out = seg if not out else (out + seg if seg.startswith("[") else f"{out}.{seg}")
    return out


def _flipped(value):
    if isinstance(value, bool):
        return not value
    if isinstance(value, int):
        return value + 1
    if isinstance(value, float):
        return value * 2 + 1
    if isinstance(value, str) and len(value) == 64 and set(value) <= set(HEX):
        return HEX[(HEX.index(value[0]) + 1) % 16] + value[1:]
    if isinstance(value, str):
        return value + "x"
    if isinstance(value, list):
        return [*value, "flipped"]
    assert value == {}, value
    return {"FLIPPED": "1"}


def _set(doc: dict, keys, value) -> dict:
    out = json.loads(json.dumps(doc))
    target = out
    for k in keys[:-1]:
        target = target[k]
    target[keys[-1]] = value
    return out


def _explain(capsys, *argv) -> tuple[int, str]:
    capsys.readouterr()
    code = main(["cache", "explain", *argv])
    out = capsys.readouterr()
    return code, out.out + out.err


def test_the_part_list_is_the_real_records(real):
    assert list(real[2]) == sorted(PARTS) and real[2]["name"] == real[0]


@pytest.mark.parametrize("part", PARTS)
def test_explain_names_each_flipped_part_with_its_stored_and_wanted_values(part, real, tmp_path, capsys):
    name, fp, doc = real
    root = tmp_path / "kc"
    blob = tmp_path / "program.pt2"
    blob.write_bytes(b"program")
    assert KernelCacheClient(root=root).publish(name, fp, blob, parts=json.dumps(doc)) == "PUBLISHED"
    leaves = [(keys, v) for keys, v in _leaves(doc) if keys[0] == part]
    assert leaves
    for keys, old in leaves:
        new = _flipped(old)
        wanted = _set(doc, keys, new)
        parts_file = tmp_path / "wanted.json"
        parts_file.write_text(json.dumps(wanted))
        code, out = _explain(capsys, "--parts", str(parts_file), "--root", str(root), "--json")
        assert code == 0, out
        got = json.loads(out)
        assert not got["hit"] and got["fingerprint"] != fp
        if part == "name":  # entries are compared within a name: another name has none
            assert got["name"] == new and got["nearest"] == []
            continue
        path, stored, shown = _path_name(keys), old, new
        if old == {}:
            path, stored, shown = path + ".FLIPPED", "(absent)", "1"
        (nearest,) = got["nearest"]
        assert nearest["fingerprint"] == fp
        assert nearest["differences"] == [{"part": path, "stored": stored, "wanted": shown}], path
    code, out = _explain(capsys, "--parts", str(parts_file), "--root", str(root))
    assert code == 0 and (f"MISS {wanted['name']}/" in out)


def test_bad_input_to_explain_is_exit_2_with_a_sentence(real, tmp_path, capsys):
    name, fp, doc = real
    root = tmp_path / "kc"
    blob = tmp_path / "program.pt2"
    blob.write_bytes(b"program")
    KernelCacheClient(root=root).publish(name, fp, blob)
    (tmp_path / "bad.json").write_text("{not json")
    (tmp_path / "good.json").write_text(json.dumps(doc))
    cases = [
        ((), "give NAME FINGERPRINT"),
        ((name, "../x"), "fingerprint"),
        ((name, "ee" * 32), "no fingerprint parts record"),
        (("--parts", str(tmp_path / "bad.json")), "not JSON"),
        (("--parts", str(tmp_path / "missing.json")), "cannot read"),
        ((name, "ee" * 32, "--parts", str(tmp_path / "good.json")), "has fingerprint"),
    ]
    for argv, says in cases:
        code, out = _explain(capsys, *argv, "--root", str(root))
        assert code == 2 and says in out, (argv, out)


def _key_in(monkeypatch, home: Path, port: int, runner_id: str, kind: str) -> tuple[str, str]:
    monkeypatch.setenv("WARMSERVE_HOME", str(home))
    monkeypatch.setenv("WARMSERVE_KERNEL_CACHE_ADDR", f"127.0.0.1:{port}")
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(home / "ind-cache"))
    monkeypatch.setenv("WARMSERVE_PORT", str(port))
    spec = dataclasses.replace(make_runner().program_spec(), runner_id=runner_id)
    return program_key(spec, "aoti", kind=kind)


@pytest.mark.parametrize("kind", ["decode", "prefill"])
def test_ports_runner_ids_homes_and_cache_paths_are_no_parts_and_a_relocated_cache_hits(
        kind, tmp_path, monkeypatch, capsys):
    a, b = tmp_path / "home-a", tmp_path / "elsewhere" / "home-b"
    name, fp = _key_in(monkeypatch, a, 50051, "runner-0", kind)
    text = known_parts(fp)
    root_a = a / "kernel-cache"
    blob = tmp_path / "program.pt2"
    blob.write_bytes(b"program")
    assert KernelCacheClient(root=root_a).publish(name, fp, blob, producer="runner-0@h:1") == "PUBLISHED"
    assert _key_in(monkeypatch, b, 60061, "runner-7", kind) == (name, fp)
    for place in (str(tmp_path), "50051", "60061", "runner-0", "runner-7", "home-a", "home-b", "ind-cache"):
        assert place not in text, place
    named = {k.lower() for keys, _ in _leaves(json.loads(text)) if keys[0] != "sources" for k in keys}
    assert not {k for k in named if any(w in k for w in ("port", "runner", "home", "root", "cache_dir", "addr"))}
    b.mkdir(parents=True)
    shutil.move(str(root_a), str(b / "kernel-cache"))  # the home moved to another place
    assert KernelCacheClient(root=b / "kernel-cache").lookup(name, fp) is not None
    code, out = _explain(capsys, name, fp, "--root", str(b / "kernel-cache"))
    assert code == 0 and out.startswith(f"HIT {name}/{fp}")


def test_a_miss_names_the_differing_parts_in_the_programs_phase_and_explain_reads_the_runners_record(
        tmp_path, monkeypatch, capsys):
    home = tmp_path / "home"
    monkeypatch.setenv("WARMSERVE_HOME", str(home))
    root = tmp_path / "kc"
    runner = make_runner()
    threads = torch.get_num_threads()
    try:  # an entry built by a runner with one more thread
        torch.set_num_threads(threads + 1)
        name, other = program_key(runner.program_spec(), "aoti")
    finally:
        torch.set_num_threads(threads)
    blob = tmp_path / "program.pt2"
    blob.write_bytes(b"program")
    KernelCacheClient(root=root).publish(name, other, blob)
    wanted = program_key(runner.program_spec(), "aoti")[1]

    def built_here(spec, kind, name, fp, cache, work, progress, compiler=None):  # instead of a 100 s compile
        return (lambda *a: None), "compiled", "PUBLISHED", f"compiled {name} in 0.1 s here (PUBLISHED)"

    monkeypatch.setattr(aoti, "load_aoti", built_here)
    report = load_programs(runner.program_spec(), lambda kind, program: None, kernel_cache=str(root))
    line = f"MISS: nearest {name} entry {other[:12]} differs in compile_options.threads ({threads + 1} -> {threads})"
    assert line in report.detail and report.fingerprint == wanted
    assert report.detail.count("MISS") == 1  # prefill: no entry of its name
    code, out = _explain(capsys, name, wanted, "--root", str(root))  # the runner's record, from its home
    assert code == 0 and f"compile_options.threads: {threads + 1} -> {threads}" in out
