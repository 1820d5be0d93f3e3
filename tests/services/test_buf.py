"""The warmserve.v1 contracts pass buf's lint rules (buf.yaml: STANDARD, with the exceptions it
lists and why) and have no breaking change against the released v1.0.0 baseline image
(protos/baseline/v1.0.0.binpb, made with `buf build -o`). buf comes from npm (the root
package.json, installed by `make node`, which `make test` runs); without it these tests fail."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
BUF = REPO / "node_modules" / ".bin" / "buf"
BASELINE = REPO / "protos" / "baseline" / "v1.0.0.binpb"


def _buf(*args: str, cwd: Path = REPO) -> subprocess.CompletedProcess:
    if not BUF.exists():
        pytest.fail(f"{BUF.relative_to(REPO)} is missing: run `make node` (make test does)")
    return subprocess.run([str(BUF), *args], cwd=cwd, capture_output=True, text=True, timeout=120)


def test_buf_lint_passes():
    r = _buf("lint")
    assert r.returncode == 0, r.stdout + r.stderr


def test_no_breaking_change_against_the_v1_0_0_baseline():
    r = _buf("breaking", "--against", str(BASELINE))
    assert r.returncode == 0, r.stdout + r.stderr


def test_the_baseline_holds_every_warmserve_proto():
    r = _buf("ls-files", str(BASELINE))
    assert r.returncode == 0, r.stderr
    assert sorted(r.stdout.split()) == sorted(
        str(p.relative_to(REPO / "protos")) for p in (REPO / "protos" / "warmserve" / "v1").glob("*.proto"))


def _copy_module(tmp_path: Path) -> Path:
    shutil.copy(REPO / "buf.yaml", tmp_path / "buf.yaml")
    shutil.copytree(REPO / "protos" / "warmserve", tmp_path / "protos" / "warmserve")
    return tmp_path / "protos" / "warmserve" / "v1" / "generation.proto"


def test_breaking_check_catches_a_renumbered_field(tmp_path):
    """The check is not vacuous: moving a field to another number in a copy is reported."""
    proto = _copy_module(tmp_path)
    text = proto.read_text()
    assert "bool ignore_eos = 9;" in text
    proto.write_text(text.replace("bool ignore_eos = 9;", "bool ignore_eos = 99;"))
    r = _buf("breaking", "--against", str(BASELINE), cwd=tmp_path)
    assert r.returncode != 0
    assert "generation.proto" in r.stdout and "ignore_eos" in r.stdout


def test_lint_catches_an_unprefixed_enum_value(tmp_path):
    """The lint is not vacuous either: an enum value without its type's prefix is reported."""
    proto = _copy_module(tmp_path)
    text = proto.read_text()
    proto.write_text(text.replace("FINISH_REASON_ABORTED = 4;", "FINISH_REASON_ABORTED = 4;\n  TIMED_OUT = 5;"))
    r = _buf("lint", cwd=tmp_path)
    assert r.returncode != 0 and "TIMED_OUT" in r.stdout and "FINISH_REASON_" in r.stdout
