"""A router and one runner in this process on loopback (``tests/kserve_stack.py``'s
:class:`TinyStack`: a tiny random Llama checkpoint with a word-level tokenizer, token ``i`` is the
word ``w{i}``; or, for structured output, the byte-level tokenizer llguidance reads), for the
clients in other languages (clients/node) to talk to; and the command that runs those clients."""

from __future__ import annotations

import shutil
import subprocess
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from kserve_stack import TinyStack

REPO = Path(__file__).resolve().parents[2]
NODE_CLIENT = REPO / "clients" / "node"


@dataclass
class Stack:
    """The router's address, the runner's id, the checkpoint directory (the model's source) and
    the model's context length (a request for more tokens than it leaves is INVALID_ARGUMENT)."""

    address: str
    runner_id: str
    model_source: str
    max_model_len: int


@pytest.fixture(scope="package")
def stack(tmp_path_factory) -> Iterator[Stack]:
    tiny = TinyStack(tmp_path_factory.mktemp("client-stack"))
    try:
        yield Stack(tiny.address, "runner-0", str(tiny.ckpt), tiny.engine.max_model_len)
    finally:
        tiny.close()


@pytest.fixture(scope="package")
def bytes_stack(tmp_path_factory) -> Iterator[Stack]:
    """As :func:`stack`, with ``tests/structured_tiny.py``'s byte-level tokenizer (prompts are any
    text): structured output works there."""
    tiny = TinyStack(tmp_path_factory.mktemp("client-bytes-stack"), tokenizer="bytes")
    try:
        yield Stack(tiny.address, "runner-0", str(tiny.ckpt), tiny.engine.max_model_len)
    finally:
        tiny.close()


NodeRun = Callable[..., subprocess.CompletedProcess]


@pytest.fixture(scope="session")
def node_exe() -> str:
    """The ``node`` executable, with clients/node's packages installed. Fails (never skips) when
    either is missing, naming the command that installs them."""
    exe = shutil.which("node")
    if exe is None:
        pytest.fail("`node` is not on PATH: run `make node` (installs Node.js and clients/node's packages)")
    for package in ("@grpc/grpc-js", "@grpc/proto-loader"):
        if not (NODE_CLIENT / "node_modules" / package / "package.json").is_file():
            pytest.fail(f"{NODE_CLIENT / 'node_modules' / package} is missing: run `make node` "
                        "(npm ci --prefix clients/node)")
    return exe


@pytest.fixture(scope="session")
def node_cli(node_exe: str) -> NodeRun:
    """``node_cli(script, *args, timeout_s=60)`` runs ``node clients/node/<script> args...`` from a
    directory other than the repository (the scripts find the .proto files themselves) and returns
    the completed process (text output)."""

    def run(script: str, *args: str, timeout_s: float = 60) -> subprocess.CompletedProcess:
        return subprocess.run([node_exe, str(NODE_CLIENT / script), *args], capture_output=True, text=True,
                              timeout=timeout_s, cwd="/")

    return run
