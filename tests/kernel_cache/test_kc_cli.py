"""``warmserve cache ...``: every command against an embedded store and a daemon, exit codes
(2 bad input, 1 failed operation) and one-line error messages."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from auth_tokens import make_creds
from kc_workers import REPO, child_env, tree_digest

from warmserve.cli import main


def run(capsys, *argv: str) -> tuple[int, str, str]:
    """Run ``warmserve cache ARGV`` in-process; returns (exit code, stdout, stderr)."""
    try:
        code = main(["cache", *argv])
    except SystemExit as e:  # argparse usage errors
        code = e.code
    out, err = capsys.readouterr()
    return code, out, err


def run_process(*argv: str) -> subprocess.CompletedProcess:
    """Run the real ``warmserve cache ARGV`` in a new process."""
    return subprocess.run([sys.executable, "-m", "warmserve.cli", "cache", *argv], capture_output=True,
                          text=True, env=child_env(), cwd=REPO, timeout=120)


@pytest.fixture
def artifacts(tmp_path: Path) -> tuple[Path, Path]:
    f = tmp_path / "prog.so"
    f.write_bytes(os.urandom(200_000))
    d = tmp_path / "cache-dir"
    (d / "sub").mkdir(parents=True)
    (d / "sub" / "k.so").write_bytes(os.urandom(10_000))
    return f, d


@pytest.mark.parametrize("where", ["root", "addr"])
def test_every_command_round_trips(capsys, tmp_path, artifacts, grpc_cache, where):
    f, d = artifacts
    target = ["--root", str(tmp_path / "root")] if where == "root" else ["--addr", grpc_cache().address]
    code, out, _ = run(capsys, "put", "llama.decode", "f1", str(f), *target)
    assert code == 0 and out.startswith("PUBLISHED llama.decode/f1 200000 bytes")
    code, out, _ = run(capsys, "put", "llama.decode", "f1", str(f), *target)
    assert code == 0 and out.startswith("ALREADY_PRESENT")
    assert run(capsys, "put", "llama.decode", "d1", str(d), *target)[0] == 0
    code, out, _ = run(capsys, "get", "llama.decode", "f1", str(tmp_path / "out.so"), *target)
    assert code == 0 and "200000 bytes" in out
    assert (tmp_path / "out.so").read_bytes() == f.read_bytes()
    assert run(capsys, "get", "llama.decode", "d1", str(tmp_path / "out-dir"), *target)[0] == 0
    assert tree_digest(tmp_path / "out-dir") == tree_digest(d)
    code, out, _ = run(capsys, "ls", *target)
    header, *rows = [ln.split() for ln in out.splitlines()]
    assert code == 0 and header == ["NAME", "FINGERPRINT", "BYTES", "FORMAT", "LAST_ACCESS", "PRODUCER"]
    assert [(r[0], r[1], r[3]) for r in rows] == [("llama.decode", "d1", "dir"), ("llama.decode", "f1", "file")]
    assert rows[1][2] == "200000"
    code, out, _ = run(capsys, "ls", "llama", "--json", *target)
    entries = [json.loads(ln) for ln in out.splitlines()]
    assert [(e["fingerprint"], e["format"]) for e in entries] == [("d1", "dir"), ("f1", "file")]
    assert run(capsys, "ls", "qwen", *target)[1].splitlines()[1:] == []
    code, out, _ = run(capsys, "stat", *target)
    stats = json.loads(out)
    assert code == 0 and stats["entries"] == 2 and stats["total_bytes"] == 200_000 + entries[0]["size_bytes"]
    code, out, _ = run(capsys, "evict", "llama.decode", "f1", *target)
    assert code == 0 and out.strip() == "evicted 1 entries, freed 200000 bytes"
    code, out, _ = run(capsys, "evict", "--all", *target)
    assert code == 0 and out.startswith("evicted 1 entries")


@pytest.mark.parametrize("bad", ["../x", "", "a" * 10_000])
def test_bad_keys_exit_2_with_one_line(capsys, tmp_path, artifacts, bad):
    f, _ = artifacts
    for argv in (["put", bad, "f", str(f)], ["put", "n", bad, str(f)], ["get", bad, "f", str(tmp_path / "o")],
                 ["evict", bad]):
        code, out, err = run(capsys, *argv, "--root", str(tmp_path / "root"))
        assert code == 2, (argv[:2], err)
        assert err.startswith("warmserve: error:") and len(err.strip().splitlines()) == 1
        assert len(err) < 300
    assert not (tmp_path / "o").exists()


def test_bad_input_and_failed_operations(capsys, tmp_path, artifacts, grpc_cache):
    f, _ = artifacts
    root = ["--root", str(tmp_path / "root")]
    code, _, err = run(capsys, "get", "llama.decode", "absent", str(tmp_path / "o"), *root)
    assert code == 1 and "MISS" in err and len(err.strip().splitlines()) == 1
    code, _, err = run(capsys, "put", "n", "f", str(tmp_path / "missing"), *root)
    assert code == 2 and "not a file or a directory" in err
    (tmp_path / "empty").write_bytes(b"")
    code, _, err = run(capsys, "put", "n", "f", str(tmp_path / "empty"), *root)
    assert code == 2 and "empty artifact" in err and len(err.strip().splitlines()) == 1
    code, _, err = run(capsys, "put", "n", "UNKNOWN", str(f), *root)
    assert code == 2 and "UNKNOWN is never stored" in err  # bad input, refused before any I/O
    assert run(capsys, "evict", *root)[0] == 2
    assert run(capsys, "evict", "n", "--all", *root)[0] == 2
    assert run(capsys, "ls", "--root", "r", "--addr", "127.0.0.1:1")[0] == 2  # mutually exclusive
    code, _, err = run(capsys, "stat", "--addr", "127.0.0.1:1")
    assert code == 1 and "127.0.0.1:1" in err and len(err.strip().splitlines()) == 1
    # A daemon with an auth file: every command needs --token-file with its scope.
    creds = make_creds(tmp_path / "auth", publisher="read,publish", admin="admin")
    cache = grpc_cache(auth=creds.table)
    addr = ["--addr", cache.address]
    code, _, err = run(capsys, "put", "n", "f", str(f), *addr)
    assert code == 1 and "bearer token" in err
    pub = ["--token-file", str(creds.token_file("publisher"))]
    assert run(capsys, "put", "n", "f", str(f), *addr, *pub)[0] == 0
    assert run(capsys, "put", "n", "g", str(f), *addr, "--token-file", str(tmp_path / "nope"))[0] == 2
    assert run(capsys, "get", "n", "f", str(tmp_path / "o2"), *addr, *pub)[0] == 0
    assert run(capsys, "evict", "--all", *addr, *pub)[0] == 1
    assert run(capsys, "evict", "--all", *addr, "--token-file", str(creds.token_file("admin")))[0] == 0


def test_real_processes_and_daemon(tmp_path, artifacts, daemon):
    f, _ = artifacts
    creds = make_creds(tmp_path / "auth", publisher="read,publish")
    d = daemon("--auth-file", str(creds.auth_file), "--max-bytes", "1000000")
    bad = run_process("put", "../x", "f", str(f), "--addr", d.address)
    assert bad.returncode == 2 and bad.stderr.startswith("warmserve: error:")
    denied = run_process("put", "n", "f", str(f), "--addr", d.address)
    assert denied.returncode == 1 and "bearer token" in denied.stderr
    ok = run_process("put", "n", "f", str(f), "--addr", d.address, "--token-file", str(creds.token_file("publisher")))
    assert ok.returncode == 0 and ok.stdout.startswith("PUBLISHED")
    pub = ("--token-file", str(creds.token_file("publisher")))
    miss = run_process("get", "n", "g", str(tmp_path / "o"), "--addr", d.address, *pub)
    assert miss.returncode == 1 and "MISS" in miss.stderr
    stat = run_process("stat", "--addr", d.address, *pub)
    assert stat.returncode == 0 and json.loads(stat.stdout)["max_bytes"] == 1_000_000
    busy = run_process("serve", "--root", str(tmp_path / "r2"), "--port", d.address.rsplit(":", 1)[1])
    assert busy.returncode == 1
    assert busy.stderr.strip().splitlines()[-1].startswith("warmserve: error: cannot bind 127.0.0.1:")
    assert busy.stderr.strip().endswith(": address already in use") and not (tmp_path / "r2").exists()


def test_commands_that_store_nothing_create_nothing(capsys, tmp_path, artifacts):
    """A typo in --root leaves no directory behind: only put creates a store."""
    f, _ = artifacts
    typo = tmp_path / "no" / "such" / "dir"
    for argv in (["ls"], ["stat"], ["get", "n", "f", str(tmp_path / "out")], ["evict", "n"], ["evict", "--all"]):
        code, out, err = run(capsys, *argv, "--root", str(typo))
        assert code == 1 and "no kernel-cache store at" in err and len(err.strip().splitlines()) == 1, argv
        assert not (tmp_path / "no").exists(), argv
    code, _, err = run(capsys, "put", "n", "f", str(tmp_path / "missing"), "--root", str(typo))
    assert code == 2 and "not a file or a directory" in err and not (tmp_path / "no").exists()
    code, _, err = run(capsys, "put", "../n", "f", str(f), "--root", str(typo))
    assert code == 2 and not (tmp_path / "no").exists()
    assert run(capsys, "put", "n", "f", str(f), "--root", str(typo))[0] == 0  # a store is made to store
    code, out, _ = run(capsys, "ls", "--root", str(typo))
    assert code == 0 and "n " in out
